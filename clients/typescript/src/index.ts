// A small typed wrapper over the generated Connect client: one transport
// (gRPC over HTTP/2), the API key as a bearer token, streams as async
// iterators that stop the RPC when the loop ends or the AbortSignal fires,
// errors decoded into TokenspoutError subclasses, and bounded retries of calls
// that have received nothing yet (honouring the server's RetryInfo).
import { setTimeout as sleep } from "node:timers/promises";
import { create, type MessageInitShape } from "@bufbuild/protobuf";
import { createClient, type Client, type Interceptor } from "@connectrpc/connect";
import { Http2SessionManager, createGrpcTransport } from "@connectrpc/connect-node";
import {
  ConstraintSchema,
  GenerationService,
  ToolCallSchema,
  type CancelResponse,
  type CompileConstraintResponse,
  type Constraint,
  type GenerateRequestSchema,
  type GenerateResponse,
  type GenerateStreamRequestSchema,
  type GenerateStreamResponse,
  type GetModelInfoResponse,
  type GetServerStatusResponse,
  type TokenizeRequestSchema,
  type TokenizeResponse,
  type ToolCall,
} from "./gen/tokenspout/v1/generation_pb.js";
import { Code, ConnectError } from "@connectrpc/connect";
import { AFFINITY_HEADER, affinityKey } from "./affinity.js";
import { decodeError, type TokenspoutError } from "./errors.js";

export * from "./affinity.js";
export * from "./errors.js";
export * from "./gen/tokenspout/v1/generation_pb.js";

export interface TlsOptions {
  /** PEM root certificates to trust instead of the system ones. */
  ca?: string | Buffer;
  /** PEM client certificate and key, for mutual TLS. */
  cert?: string | Buffer;
  key?: string | Buffer;
  /** The name to check the server certificate against, when it differs from the host. */
  serverName?: string;
}

export interface ClientOptions {
  /** "host:port", or a URL: "http://host:port" (plaintext) or "https://host:port". */
  address: string;
  /** Sent as `authorization: Bearer <apiKey>` on every call. */
  apiKey?: string;
  /** true: TLS with the system roots; an object: TLS with these settings. */
  tls?: boolean | TlsOptions;
  /** The deadline of each call (retries included) unless the call sets its own. */
  timeoutMs?: number;
  /** Retries of overloaded or unavailable calls that have received nothing yet (default 2). */
  maxRetries?: number;
  /** Called before each retry, with the error and the wait. */
  onRetry?: (error: TokenspoutError, delayMs: number) => void;
  /** Send each generation's affinity key (x-tokenspout-affinity; default true), which Envoy and
   * HAProxy in deploy/ route on so that a chat's turns reuse one replica's prefix cache. */
  affinity?: boolean;
}

export interface CallOptions {
  signal?: AbortSignal;
  timeoutMs?: number;
}

export interface GenerateCallOptions extends CallOptions {
  /** The affinity key to send instead of one derived from the input: calls with the same
   * session id go to the same replica behind Envoy or HAProxy. */
  sessionId?: string;
}

export type StreamRequest = MessageInitShape<typeof GenerateStreamRequestSchema>;
export type GenerateRequestInit = MessageInitShape<typeof GenerateRequestSchema>;
export type TokenizeRequestInit = MessageInitShape<typeof TokenizeRequestSchema>;
export type ConstraintInit = MessageInitShape<typeof ConstraintSchema>;

/** A constraint from a JSON Schema given as an object. */
export function jsonSchema(
  schema: object,
  options: { strict?: boolean; whitespaceFlexible?: boolean; maxWhitespace?: number } = {},
): Constraint {
  return create(ConstraintSchema, { ...options, kind: { case: "jsonSchema", value: JSON.stringify(schema) } });
}

function baseUrl(address: string, tls: ClientOptions["tls"]): string {
  if (/^https?:\/\//.test(address)) return address;
  return `${tls ? "https" : "http"}://${address}`;
}

function bearer(apiKey: string): Interceptor {
  return (next) => (request) => {
    request.header.set("authorization", `Bearer ${apiKey}`);
    return next(request);
  };
}

const RETRYABLE = new Set([Code.ResourceExhausted, Code.Unavailable]);

/** A stream's responses grouped by sample (`index`, see GenerateStreamRequest.n), each sample's in order. */
export function bySample(responses: Iterable<GenerateStreamResponse>): Map<number, GenerateStreamResponse[]> {
  const samples = new Map<number, GenerateStreamResponse[]>();
  for (const response of responses) {
    if (response.heartbeat) continue;
    const sample = samples.get(response.index) ?? [];
    sample.push(response);
    samples.set(response.index, sample);
  }
  return samples;
}

/** The tool calls that a stream's `toolCallDeltas` form, in order (as the Python client's
 * `assemble_tool_calls`): a call's first delta carries its index, id and name, the later ones
 * the next characters of its arguments. Give it one sample's responses (see `bySample`); on a
 * stream cut short, the last call's arguments are cut short too. */
export function assembleToolCalls(responses: Iterable<GenerateStreamResponse>): ToolCall[] {
  const calls = new Map<number, ToolCall>();
  for (const response of responses) {
    for (const delta of response.toolCallDeltas) {
      const call = calls.get(delta.index) ?? create(ToolCallSchema, { id: delta.id, name: delta.name });
      call.arguments += delta.argumentsDelta;
      calls.set(delta.index, call);
    }
  }
  return [...calls].sort(([a], [b]) => a - b).map(([, call]) => call);
}

export class TokenspoutClient {
  /** The generated client, for anything the wrapper does not cover. */
  readonly raw: Client<typeof GenerationService>;
  private readonly options: ClientOptions;
  private readonly sessions: Http2SessionManager;

  constructor(options: ClientOptions) {
    const tls = typeof options.tls === "object" ? options.tls : {};
    const url = baseUrl(options.address, options.tls);
    const nodeOptions = { ca: tls.ca, cert: tls.cert, key: tls.key, servername: tls.serverName };
    // One HTTP/2 connection, kept alive with pings, that close() can end.
    this.sessions = new Http2SessionManager(url, { pingIntervalMs: 30_000 }, nodeOptions);
    const transport = createGrpcTransport({
      baseUrl: url,
      interceptors: options.apiKey ? [bearer(options.apiKey)] : [],
      sessionManager: this.sessions,
    });
    this.raw = createClient(GenerationService, transport);
    this.options = options;
  }

  /** Closes the connection; calls still running fail. */
  close(): void {
    this.sessions.abort();
  }

  /** Streams a generation; heartbeats are skipped. Leaving the loop cancels the RPC. */
  async *stream(request: StreamRequest, options: GenerateCallOptions = {}): AsyncGenerator<GenerateStreamResponse> {
    const deadline = this.deadline(options);
    const affinity = this.affinityHeaders(request, options);
    // Ending Connect's iterator early does not reset the HTTP/2 stream, and its
    // deadline timer outlives a stream left early; so this call aborts the
    // stream itself and keeps its own timer (sending the deadline as grpc-timeout).
    const call = new AbortController();
    const abort = () => call.abort(options.signal?.reason);
    if (options.signal?.aborted) abort();
    options.signal?.addEventListener("abort", abort, { once: true });
    const timer =
      deadline === undefined
        ? undefined
        : setTimeout(
            () => call.abort(new ConnectError("the operation timed out", Code.DeadlineExceeded)),
            deadline - Date.now(),
          );
    try {
      for (let retries = 0; ; retries++) {
        let received = false;
        try {
          const headers: Record<string, string> = { ...affinity };
          if (deadline !== undefined) headers["grpc-timeout"] = `${Math.max(1, deadline - Date.now())}m`;
          const attempt = { signal: call.signal, headers };
          for await (const response of this.raw.generateStream(request, attempt)) {
            received = true;
            if (!response.heartbeat) yield response;
          }
          return;
        } catch (error) {
          // A stream that has received anything is never retried: its output has begun.
          await this.beforeRetry(decodeError(error), received ? Infinity : retries, deadline, call.signal);
        }
      }
    } finally {
      clearTimeout(timer);
      options.signal?.removeEventListener("abort", abort);
      call.abort(); // leaving the loop early (break, return, throw) cancels the RPC
    }
  }

  async generate(request: GenerateRequestInit, options: GenerateCallOptions = {}): Promise<GenerateResponse> {
    const headers = this.affinityHeaders(request, options);
    return this.unary((call) => this.raw.generate(request, { ...call, headers }), options);
  }

  async tokenize(request: TokenizeRequestInit, options?: CallOptions): Promise<TokenizeResponse> {
    return this.unary((call) => this.raw.tokenize(request, call), options);
  }

  async modelInfo(options?: CallOptions): Promise<GetModelInfoResponse> {
    return this.unary((call) => this.raw.getModelInfo({}, call), options);
  }

  async compile(constraint: ConstraintInit, options?: CallOptions): Promise<CompileConstraintResponse> {
    return this.unary((call) => this.raw.compileConstraint({ constraint }, call), options);
  }

  async cancel(requestIds: string[], options?: CallOptions): Promise<CancelResponse> {
    return this.unary((call) => this.raw.cancel({ requestIds }, call), options);
  }

  async status(options?: CallOptions): Promise<GetServerStatusResponse> {
    return this.unary((call) => this.raw.getServerStatus({}, call), options);
  }

  private async unary<T>(call: (options: CallOptions) => Promise<T>, options: CallOptions = {}): Promise<T> {
    const deadline = this.deadline(options);
    for (let retries = 0; ; retries++) {
      try {
        return await call(this.attempt(options, deadline));
      } catch (error) {
        await this.beforeRetry(decodeError(error), retries, deadline, options.signal);
      }
    }
  }

  private affinityHeaders(request: StreamRequest | GenerateRequestInit, options: GenerateCallOptions): Record<string, string> {
    if (this.options.affinity === false) return {};
    return { [AFFINITY_HEADER]: affinityKey(request, options.sessionId) };
  }

  private deadline(options: CallOptions): number | undefined {
    const timeoutMs = options.timeoutMs ?? this.options.timeoutMs;
    return timeoutMs === undefined ? undefined : Date.now() + timeoutMs;
  }

  private attempt(options: CallOptions, deadline: number | undefined): CallOptions {
    const timeoutMs = deadline === undefined ? undefined : Math.max(1, deadline - Date.now());
    return { signal: options.signal, timeoutMs };
  }

  /** Waits before the next try, or throws the error when it should not be retried. */
  private async beforeRetry(
    error: TokenspoutError,
    retries: number,
    deadline: number | undefined,
    signal: AbortSignal | undefined,
  ): Promise<void> {
    if (!RETRYABLE.has(error.code) || retries >= (this.options.maxRetries ?? 2)) throw error;
    const delayMs =
      error.retryAfterMs !== undefined
        ? error.retryAfterMs * (1 + Math.random() * 0.2)
        : Math.min(8000, 500 * 2 ** retries) * (0.5 + Math.random() * 0.5);
    if (deadline !== undefined && Date.now() + delayMs >= deadline) throw error;
    this.options.onRetry?.(error, delayMs);
    await sleep(delayMs, undefined, { signal });
  }
}
