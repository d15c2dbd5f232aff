// The affinity key: the x-tokenspout-affinity header that pins calls sharing a
// prefix to one replica (Envoy's ring_hash and HAProxy's balance hdr in
// deploy/ route on it). The rule is the Python client's
// (clients/python/tokenspout/affinity.py, docs/clients.md "Affinity key");
// clients/affinity-vectors.json holds the test vectors both clients pass.
import { createHash } from "node:crypto";

export const AFFINITY_HEADER = "x-tokenspout-affinity";
const PROMPT_CHARACTERS = 256;
const SESSION_ID = /^[\x21-\x7e]{1,128}$/;

function digest(data: string): string {
  return createHash("sha256").update(data, "utf8").digest("hex").slice(0, 32);
}

/** A caller's session id, sent as it is. */
export function sessionKey(sessionId: string): string {
  if (!SESSION_ID.test(sessionId)) {
    throw new RangeError("sessionId must be 1 to 128 visible ASCII characters (it travels as a header)");
  }
  return sessionId;
}

/** A chat's key: its leading messages up to and including the first user message. */
export function chatKey(messages: ReadonlyArray<{ role: string; content: string }>): string {
  let leading = "";
  for (const { role, content } of messages) {
    leading += `${role}\0${content}\0`;
    if (role === "user") break;
  }
  return `chat-${digest(leading)}`;
}

/** A prompt's key: its first 256 characters (code points, not UTF-16 units). */
export function promptKey(prompt: string): string {
  return `text-${digest(Array.from(prompt).slice(0, PROMPT_CHARACTERS).join(""))}`;
}

/** Token ids' key: their first 256, in decimal, separated by single spaces. */
export function tokenIdsKey(ids: ReadonlyArray<number>): string {
  return `tokens-${digest(ids.slice(0, PROMPT_CHARACTERS).join(" "))}`;
}

interface InputInit {
  input?:
    | { case: "prompt"; value: string }
    | { case: "promptTokenIds"; value: { ids?: ReadonlyArray<number> } }
    | { case: "chat"; value: { messages?: ReadonlyArray<{ role?: string; content?: string }> } }
    | { case: undefined; value?: undefined };
}

/** The key of a GenerateStream or Generate request (its init shape). */
export function affinityKey(request: InputInit, sessionId?: string): string {
  if (sessionId !== undefined) return sessionKey(sessionId);
  if (request.input?.case === "chat") {
    const messages = request.input.value.messages ?? [];
    return chatKey(messages.map((m) => ({ role: m.role ?? "", content: m.content ?? "" })));
  }
  if (request.input?.case === "promptTokenIds") return tokenIdsKey(request.input.value.ids ?? []);
  return promptKey(request.input?.case === "prompt" ? request.input.value : "");
}
