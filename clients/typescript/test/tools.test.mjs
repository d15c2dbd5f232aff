// A tool call round trip through the TypeScript client against a live server (node --test):
// the call streams as deltas, assembleToolCalls puts it together, and its result goes back.
import assert from "node:assert/strict";
import { after, before, test } from "node:test";
import { FinishReason, TokenspoutClient, ToolChoiceMode, assembleToolCalls } from "../dist/index.js";
import { mainAddress, stopServers } from "./servers.mjs";

let client;

before(async () => {
  client = new TokenspoutClient({ address: await mainAddress(), timeoutMs: 120_000 });
});
after(async () => {
  client.close();
  await stopServers();
});

const weather = {
  name: "get_weather",
  description: "The current weather in a city.",
  parameters: JSON.stringify({ type: "object", properties: { city: { type: "string" } }, required: ["city"] }),
};
const ask = [{ role: "user", content: "What is the weather in Paris?" }];
const choice = (mode) => ({ choice: { case: "mode", value: mode } });

test("a required tool call streams, assembles, and its result gets an answer", async () => {
  const responses = [];
  for await (const response of client.stream({
    input: {
      case: "chat",
      value: { messages: ask, tools: [weather], toolChoice: choice(ToolChoiceMode.REQUIRED), parallelToolCalls: false },
    },
    sampling: { seed: 5n }, // the grammar forces a call; the seed keeps its arguments short enough to finish
    stopping: { maxNewTokens: 64 },
  })) {
    responses.push(response);
  }
  assert.equal(responses.at(-1).finish?.reason, FinishReason.TOOL_CALLS);
  const calls = assembleToolCalls(responses);
  assert.deepEqual(calls, responses.flatMap((r) => r.toolCalls)); // the deltas joined are the whole calls
  assert.equal(calls.length, 1);
  const [call] = calls;
  assert.equal(call.name, "get_weather");
  assert.match(call.id, /^call_[A-Za-z0-9]{24}$/);
  assert.equal(typeof JSON.parse(call.arguments).city, "string");

  const answer = await client.generate({
    input: {
      case: "chat",
      value: {
        messages: [
          ...ask,
          { role: "assistant", toolCalls: calls },
          { role: "tool", toolCallId: call.id, content: JSON.stringify({ sky: "clear", celsius: 21 }) },
        ],
        tools: [weather],
        toolChoice: choice(ToolChoiceMode.NONE),
      },
    },
    sampling: { seed: 5n },
    stopping: { maxNewTokens: 24 },
  });
  assert.ok(answer.text.trim(), "an answer in text");
  assert.deepEqual(answer.toolCalls, []);
  assert.notEqual(answer.finish?.reason, FinishReason.TOOL_CALLS);
});

test("assembleToolCalls joins each call's deltas in index order, whatever order they arrive in", () => {
  const delta = (index, argumentsDelta, id = "", name = "") => ({ index, id, name, argumentsDelta });
  const responses = [
    { toolCallDeltas: [delta(1, "", "call_b", "b"), delta(0, '{"x"', "call_a", "a")] },
    { toolCallDeltas: [] }, // a message with text only
    { toolCallDeltas: [delta(0, ":1}"), delta(1, "{}")] },
  ];
  const calls = assembleToolCalls(responses).map((c) => [c.id, c.name, c.arguments]);
  assert.deepEqual(calls, [["call_a", "a", '{"x":1}'], ["call_b", "b", "{}"]]);
});
