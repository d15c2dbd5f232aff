// The TypeScript client against a live tokenspout server (node --test).
import assert from "node:assert/strict";
import { after, before, test } from "node:test";
import {
  CancelledError,
  DeadlineExceededError,
  FinishReason,
  InvalidRequestError,
  NotFoundError,
  OverloadedError,
  TokenspoutClient,
  UnauthenticatedError,
  bySample,
  jsonSchema,
} from "../dist/index.js";
import { authAddress, fullAddress, mainAddress, stopServers } from "./servers.mjs";

let client;
let full;

before(async () => {
  client = new TokenspoutClient({ address: await mainAddress(), timeoutMs: 120_000 });
  full = await fullAddress();
});
after(async () => {
  client.close();
  await stopServers();
});

const longStopping = { maxNewTokens: 900, ignoreEos: true };

async function collect(stream) {
  const responses = [];
  for await (const response of stream) responses.push(response);
  return responses;
}

async function waitFor(condition, what) {
  for (let i = 0; i < 1500; i++) {
    if (await condition()) return;
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
  throw new Error(`timed out waiting for ${what}`);
}

test("every RPC", async () => {
  const info = await client.modelInfo();
  assert.equal(info.engine, "llama.cpp");
  assert.equal(info.limits?.maxBatchSize, 8);
  assert.equal((await client.status()).maxBatchSize, 8);
  const tokens = await client.tokenize({ input: { case: "text", value: "Hello world" } });
  assert.ok(tokens.count >= 2 && tokens.tokenIds.length === tokens.count);
  const compiled = await client.compile({ kind: { case: "regex", value: "[0-9]{2}" } });
  assert.deepEqual(compiled.warnings, []);

  const request = {
    input: { case: "prompt", value: "The capital of France is" },
    sampling: { temperature: 0 },
    stopping: { maxNewTokens: 6 },
  };
  const generated = await client.generate(request);
  const streamed = await collect(client.stream(request));
  assert.equal(streamed.map((r) => r.text).join(""), generated.text);
  assert.ok(streamed.at(-1).finish && streamed.slice(0, -1).every((r) => !r.finish));
  assert.deepEqual((await client.cancel(["never-started"])).notFound, ["never-started"]);
});

test("a JSON Schema stream parses as the schema says", async () => {
  const schema = {
    type: "object",
    properties: { name: { type: "string" }, age: { type: "integer" } },
    required: ["name", "age"],
    additionalProperties: false,
  };
  const responses = await collect(
    client.stream({
      input: { case: "chat", value: { messages: [{ role: "user", content: "Describe Ada as JSON." }] } },
      sampling: { temperature: 0 },
      stopping: { maxNewTokens: 64 },
      constraint: jsonSchema(schema),
    }),
  );
  const person = JSON.parse(responses.map((r) => r.text).join(""));
  assert.equal(typeof person.name, "string");
  assert.ok(Number.isInteger(person.age));
  assert.equal(responses.at(-1).finish.reason, FinishReason.CONSTRAINT_COMPLETE);
});

test("aborting or leaving the loop cancels the RPC", async () => {
  const before = (await client.status()).cancelledTotal;
  const abort = new AbortController();
  const aborted = client.stream(
    { requestId: "ts-abort", input: { case: "prompt", value: "Once upon a time" }, stopping: longStopping },
    { signal: abort.signal },
  );
  await assert.rejects(async () => {
    let seen = 0;
    for await (const _ of aborted) if (++seen === 3) abort.abort();
  }, CancelledError);

  for await (const _ of client.stream({
    requestId: "ts-break",
    input: { case: "prompt", value: "Once upon a time" },
    stopping: longStopping,
  })) {
    break;
  }
  await waitFor(async () => (await client.status()).cancelledTotal >= before + 2n, "two cancellations");
  assert.deepEqual((await client.cancel(["ts-abort", "ts-break"])).notFound, ["ts-abort", "ts-break"]);
});

test("a deadline ends the call", async () => {
  const request = { input: { case: "prompt", value: "Once upon a time" }, stopping: longStopping };
  await assert.rejects(collect(client.stream(request, { timeoutMs: 500 })), DeadlineExceededError);
});

test("INVALID_ARGUMENT and NOT_FOUND are decoded", async () => {
  const error = await client
    .generate({ input: { case: "prompt", value: "Hi" }, sampling: { temperature: -1, topP: 5 } })
    .catch((e) => e);
  assert.ok(error instanceof InvalidRequestError);
  assert.equal(error.reason, "INVALID_REQUEST");
  const fields = error.fieldViolations.map((v) => v.field);
  assert.ok(fields.includes("sampling.temperature") && fields.includes("sampling.top_p"), fields.join());
  const missing = await client.generate({ model: "no-such-model", input: { case: "prompt", value: "Hi" } }).catch((e) => e);
  assert.ok(missing instanceof NotFoundError);
  assert.equal(missing.reason, "MODEL_NOT_FOUND");
});

test("an overload is decoded with its retry delay, and retried", async () => {
  const retries = [];
  const patient = new TokenspoutClient({
    address: full,
    timeoutMs: 60_000,
    maxRetries: 5,
    onRetry: (error, delayMs) => retries.push({ error, delayMs }),
  });
  const impatient = new TokenspoutClient({ address: full, maxRetries: 0 });
  const busy = impatient.stream({ input: { case: "prompt", value: "Once upon a time" }, stopping: longStopping });
  const busyFirst = await busy.next(); // the one slot is taken
  assert.ok(!busyFirst.done);

  const refused = await impatient
    .generate({ input: { case: "prompt", value: "Hi" }, stopping: { maxNewTokens: 2 } })
    .catch((e) => e);
  assert.ok(refused instanceof OverloadedError, String(refused));
  assert.equal(refused.reason, "OVERLOADED");
  assert.equal(refused.retryAfterMs, 1000);

  const waiting = patient.generate({ input: { case: "prompt", value: "Hi" }, stopping: { maxNewTokens: 3 } });
  await waitFor(() => retries.length > 0, "a retry");
  await busy.return(undefined); // frees the slot
  const generated = await waiting;
  patient.close();
  impatient.close();
  assert.ok(generated.generatedTokens >= 1);
  assert.ok(retries[0].error instanceof OverloadedError && retries[0].delayMs >= 1000);
});

test("the API key is sent as a bearer token; without it the call is UNAUTHENTICATED", async () => {
  const key = `sk-${Date.now()}`;
  const address = await authAddress(key);
  const withKey = new TokenspoutClient({ address, apiKey: key, timeoutMs: 30_000 });
  const withoutKey = new TokenspoutClient({ address, timeoutMs: 30_000 });
  try {
    assert.equal((await withKey.status()).maxBatchSize, 1);
    const refused = await collect(
      withoutKey.stream({ input: { case: "prompt", value: "Hi" }, stopping: { maxNewTokens: 2 } }),
    ).catch((e) => e);
    assert.ok(refused instanceof UnauthenticatedError, String(refused));
    assert.equal(refused.reason, "UNAUTHENTICATED");
  } finally {
    withKey.close();
    withoutKey.close();
  }
});

test("n samples, token input, truncation and token offsets", async () => {
  const info = await client.modelInfo();
  assert.ok(info.requestFeatures.includes("n") && info.limits?.maxSamples === 16);
  const tokens = await client.tokenize({ texts: ["héllo 🙂", "world"], returnOffsets: true, addSpecialTokens: false });
  assert.equal(tokens.results.length, 2);
  assert.equal(tokens.results[0].offsets?.byteEnds.at(-1), Buffer.byteLength("héllo 🙂"));
  assert.equal(tokens.results[0].offsets?.charEnds.at(-1), [..."héllo 🙂"].length);
  const request = {
    input: { case: "promptTokenIds", value: { ids: [...tokens.results[0].tokenIds, ...tokens.results[1].tokenIds] } },
    n: 3,
    truncateInputTokens: 2,
    sampling: { temperature: 1, seed: 5n },
    stopping: { maxNewTokens: 4, ignoreEos: true },
  };
  const samples = bySample(await collect(client.stream(request)));
  assert.deepEqual([...samples.keys()].sort(), [0, 1, 2]);
  for (const [index, responses] of samples) {
    assert.equal(responses[0].inputTokens, 2);
    assert.equal(responses.at(-1).finish?.seed, 5n + BigInt(index));
  }
  const unary = await client.generate(request);
  assert.equal(unary.samples.length, 3);
  assert.equal(unary.truncatedInputTokens, tokens.results[0].count + tokens.results[1].count - 2);
});
