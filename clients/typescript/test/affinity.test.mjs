// The affinity key against the test vectors the Python client passes too
// (clients/affinity-vectors.json); no server needed.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";
import { AFFINITY_HEADER, affinityKey, chatKey, promptKey, sessionKey } from "../dist/index.js";

const vectors = JSON.parse(readFileSync(new URL("../../affinity-vectors.json", import.meta.url), "utf8"));

test("the shared affinity vectors", () => {
  assert.equal(AFFINITY_HEADER, vectors.header);
  for (const c of vectors.cases) {
    const key =
      c.session_id !== undefined ? sessionKey(c.session_id) : c.messages ? chatKey(c.messages) : promptKey(c.prompt);
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
