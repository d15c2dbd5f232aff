// The affinity key against the test vectors the Python client passes too
// (clients/affinity-vectors.json), and the header the client sends (to a bare
// HTTP/2 server that records it); no tokenspout server needed.
import assert from "node:assert/strict";
import { once } from "node:events";
import { readFileSync } from "node:fs";
import http2 from "node:http2";
import { test } from "node:test";
import {
  AFFINITY_HEADER,
  TokenspoutClient,
  UnimplementedError,
  affinityKey,
  chatKey,
  promptKey,
  tokenIdsKey,
  sessionKey,
} from "../dist/index.js";

const vectors = JSON.parse(readFileSync(new URL("../../affinity-vectors.json", import.meta.url), "utf8"));

test("the shared affinity vectors", () => {
  assert.equal(AFFINITY_HEADER, vectors.header);
  for (const c of vectors.cases) {
    const key =
      c.session_id !== undefined ? sessionKey(c.session_id) : c.messages ? chatKey(c.messages)
        : c.token_ids ? tokenIdsKey(c.token_ids) : promptKey(c.prompt);
    assert.equal(key, c.key, c.name);
  }
});

test("the key of a request's init shape", () => {
  const chat = vectors.cases.find((c) => c.messages?.length === 4);
  assert.equal(affinityKey({ input: { case: "chat", value: { messages: chat.messages } } }), chat.key);
  assert.equal(affinityKey({ input: { case: "prompt", value: "The capital of France is" } }), promptKey("The capital of France is"));
  assert.equal(affinityKey({ input: { case: "prompt", value: "x" } }, "s-1"), "s-1");
  assert.throws(() => sessionKey("has space"), RangeError);
});

test("generate and stream send the key", async () => {
  const seen = [];
  const server = http2.createServer();
  server.on("stream", (stream, headers) => {
    seen.push(headers[AFFINITY_HEADER]);
    stream.respond({ ":status": 200, "content-type": "application/grpc", "grpc-status": "12" }, { endStream: true });
  });
  server.listen(0, "127.0.0.1");
  await once(server, "listening");
  const address = `127.0.0.1:${server.address().port}`;
  const chat = [{ role: "user", content: "Name a sea." }];
  const clients = [new TokenspoutClient({ address, maxRetries: 0 }), new TokenspoutClient({ address, affinity: false })];
  try {
    const [client, keyless] = clients;
    await assert.rejects(client.generate({ input: { case: "prompt", value: "Hello" } }), UnimplementedError);
    await assert.rejects(async () => {
      for await (const _ of client.stream({ input: { case: "chat", value: { messages: chat } } }));
    }, UnimplementedError);
    await assert.rejects(client.generate({ input: { case: "prompt", value: "Hello" } }, { sessionId: "s-1" }));
    await assert.rejects(keyless.generate({ input: { case: "prompt", value: "Hello" } }));
  } finally {
    for (const c of clients) c.close();
    server.close();
  }
  assert.deepEqual(seen, [promptKey("Hello"), chatKey(chat), "s-1", undefined]);
});
