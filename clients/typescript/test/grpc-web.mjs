// A gRPC-Web caller, as a browser would be: Connect's gRPC-Web transport
// (@connectrpc/connect-node, pinned in package.json) over HTTP/1.1, through
// deploy/envoy's grpc_web filter at ENVOY_URL. Run by tests/deploy/test_envoy_http.py,
// which checks what it prints (one JSON object).
import { createClient } from "@connectrpc/connect";
import { createGrpcWebTransport } from "@connectrpc/connect-node";
import { GenerationService, decodeError } from "../dist/index.js";

const transport = createGrpcWebTransport({ baseUrl: process.env.ENVOY_URL, httpVersion: "1.1" });
const client = createClient(GenerationService, transport);
const request = {
  input: { case: "prompt", value: process.env.PROMPT },
  sampling: { temperature: 0 },
  stopping: { maxNewTokens: Number(process.env.MAX_NEW_TOKENS), ignoreEos: true },
};

const texts = [];
const counts = []; // generatedTokens after each message: several tokens may share one
let finish;
for await (const response of client.generateStream(request)) {
  texts.push(response.text);
  counts.push(response.generatedTokens);
  if (response.finish) finish = { reason: response.finish.reason, generatedTokens: response.generatedTokens };
}
let error;
try {
  for await (const _ of client.generateStream({ ...request, sampling: { temperature: 5000 } }));
} catch (caught) {
  const decoded = decodeError(caught);
  error = { code: decoded.code, reason: decoded.reason, fields: decoded.fieldViolations.map((v) => v.field) };
}
process.stdout.write(JSON.stringify({ texts, counts, finish, error }));
