// Live tokenspout servers for the tests: the addresses in TOKENSPOUT_ADDRESS
// (max batch 8) and TOKENSPOUT_FULL_ADDRESS (one slot, no queue) when given
// (tests/clients/test_client_typescript.py passes them), else servers started here;
// a server with an API key is always started here.
import { spawn } from "node:child_process";
import { createHash } from "node:crypto";
import { once } from "node:events";
import path from "node:path";
import { fileURLToPath } from "node:url";

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../../..");
const python = process.env.PYTHON ?? path.join(root, ".venv/bin/python");
const started = [];

function start(flags, env = {}) {
  const server = spawn(python, ["-m", "service.cli", "serve", "--listen", "127.0.0.1:0", ...flags], {
    cwd: root,
    env: { ...process.env, ...env },
    stdio: ["ignore", "pipe", "ignore"],
  });
  started.push(server);
  return new Promise((resolve, reject) => {
    let log = "";
    server.stdout.setEncoding("utf8").on("data", (chunk) => {
      log += chunk;
      const match = /tokenspout serving .* on (\S+:\d+)/.exec(log);
      if (match) resolve(match[1]);
    });
    server.on("exit", (code) => reject(new Error(`server exited with ${code}:\n${log}`)));
  });
}

export async function mainAddress() {
  return process.env.TOKENSPOUT_ADDRESS ?? start(["--max-batch-size", "8", "--context-length", "1024"]);
}

export async function fullAddress() {
  return (
    process.env.TOKENSPOUT_FULL_ADDRESS ??
    start(["--max-batch-size", "1", "--max-queued-requests", "0", "--context-length", "1024"])
  );
}

/** A server that wants `authorization: Bearer <key>` (always started here). */
export async function authAddress(key) {
  const digest = createHash("sha256").update(key).digest("hex");
  return start(["--max-batch-size", "1", "--context-length", "256"], { TOKENSPOUT_API_KEYS: `ts:${digest}` });
}

export async function stopServers() {
  for (const server of started) {
    if (server.exitCode !== null) continue;
    const exited = once(server, "exit");
    server.kill("SIGTERM");
    await exited;
  }
}
