// Typed errors decoded from the google.rpc details the server sends
// (ErrorInfo always, BadRequest and RetryInfo where they apply).
import { Code, ConnectError } from "@connectrpc/connect";
import { BadRequestSchema, ErrorInfoSchema, RetryInfoSchema } from "./gen/google/rpc/error_details_pb.js";

/** Every ErrorInfo.reason the server sends, under the status it comes with. */
export const Reason = {
  /** INVALID_ARGUMENT: a field is wrong; see fieldViolations (every one at once). */
  INVALID_REQUEST: "INVALID_REQUEST",
  /** INVALID_ARGUMENT: the request bytes are not a valid message. */
  MALFORMED_REQUEST: "MALFORMED_REQUEST",
  /** INVALID_ARGUMENT: the constraint could not be enforced past some point mid-stream. */
  CONSTRAINT_FAILED: "CONSTRAINT_FAILED",
  /** OUT_OF_RANGE: the prompt does not fit the context. */
  OUT_OF_RANGE: "OUT_OF_RANGE",
  /** NOT_FOUND: `model` names a model this server does not serve. */
  MODEL_NOT_FOUND: "MODEL_NOT_FOUND",
  /** UNIMPLEMENTED: this engine lacks a sampler or feature the request asks for. */
  NOT_SUPPORTED: "NOT_SUPPORTED",
  /** ALREADY_EXISTS: the caller's request with this requestId is still running. */
  REQUEST_ID_IN_USE: "REQUEST_ID_IN_USE",
  /** RESOURCE_EXHAUSTED: every batch place and queue place is taken; retry after retryAfterMs. */
  OVERLOADED: "OVERLOADED",
  /** RESOURCE_EXHAUSTED: you hold as many requests as one caller may; others are still served. */
  CALLER_OVER_LIMIT: "CALLER_OVER_LIMIT",
  /** RESOURCE_EXHAUSTED: your queued request gave its place to a caller under its share (or a more urgent one). */
  SHED: "SHED",
  /** RESOURCE_EXHAUSTED: too many large constraints are compiling; retry shortly. */
  TOO_MANY_COMPILES: "TOO_MANY_COMPILES",
  /** RESOURCE_EXHAUSTED: the constraint is still compiling; a retry once it is cached starts at once. */
  COMPILE_BUDGET_EXCEEDED: "COMPILE_BUDGET_EXCEEDED",
  /** UNAUTHENTICATED: no valid API key. */
  UNAUTHENTICATED: "UNAUTHENTICATED",
  /** PERMISSION_DENIED: a priority above 0, which the server's priority_callers does not allow you. */
  PRIORITY_NOT_ALLOWED: "PRIORITY_NOT_ALLOWED",
  /** ABORTED: the caller read nothing for the server's max_pause_s, so its stream was ended. */
  PAUSED_TOO_LONG: "PAUSED_TOO_LONG",
  /** UNAVAILABLE: the server is shutting down; retry on another replica. */
  DRAINING: "DRAINING",
  /** UNAVAILABLE: the server's engine stopped; retry on another replica. */
  ENGINE_DOWN: "ENGINE_DOWN",
  /** UNAVAILABLE: the request did not start within its queueTimeoutMs; retry on another replica. */
  QUEUE_TIMEOUT: "QUEUE_TIMEOUT",
  /** DEADLINE_EXCEEDED: the caller's deadline passed; what streamed before stays delivered. */
  DEADLINE_EXCEEDED: "DEADLINE_EXCEEDED",
  /** INTERNAL: the engine failed this one request; metadata.request_id names it. */
  ENGINE_FAILURE: "ENGINE_FAILURE",
  /** INTERNAL: a server bug, logged under metadata.request_id. */
  INTERNAL: "INTERNAL",
} as const;
export type Reason = (typeof Reason)[keyof typeof Reason];

export interface FieldViolation {
  field: string;
  description: string;
}

export class TokenspoutError extends Error {
  /** The gRPC status code. */
  readonly code: Code;
  /** ErrorInfo.reason: a stable name such as OVERLOADED or INVALID_REQUEST ("" when absent). */
  readonly reason: string;
  readonly metadata: Record<string, string>;
  readonly fieldViolations: FieldViolation[];
  /** RetryInfo.retry_delay in milliseconds, when the server sent one. */
  readonly retryAfterMs: number | undefined;

  constructor(error: ConnectError) {
    super(error.rawMessage, { cause: error });
    this.name = new.target.name;
    this.code = error.code;
    const info = error.findDetails(ErrorInfoSchema)[0];
    this.reason = info?.reason ?? "";
    this.metadata = { ...(info?.metadata ?? {}) };
    this.fieldViolations = error
      .findDetails(BadRequestSchema)
      .flatMap((bad) => bad.fieldViolations.map((v) => ({ field: v.field, description: v.description })));
    const delay = error.findDetails(RetryInfoSchema)[0]?.retryDelay;
    this.retryAfterMs = delay ? Number(delay.seconds) * 1000 + delay.nanos / 1e6 : undefined;
  }
}

export class InvalidRequestError extends TokenspoutError {}
export class OverloadedError extends TokenspoutError {}
export class UnavailableError extends TokenspoutError {}
export class NotFoundError extends TokenspoutError {}
export class UnauthenticatedError extends TokenspoutError {}
export class PermissionDeniedError extends TokenspoutError {}
export class DeadlineExceededError extends TokenspoutError {}
/** ABORTED: the server ended the stream because its caller stopped reading (PAUSED_TOO_LONG). */
export class AbortedError extends TokenspoutError {}
export class CancelledError extends TokenspoutError {}
export class UnimplementedError extends TokenspoutError {}
export class ConflictError extends TokenspoutError {}
export class InternalError extends TokenspoutError {}

const classes: Partial<Record<Code, new (error: ConnectError) => TokenspoutError>> = {
  [Code.InvalidArgument]: InvalidRequestError,
  [Code.OutOfRange]: InvalidRequestError,
  [Code.FailedPrecondition]: InvalidRequestError,
  [Code.ResourceExhausted]: OverloadedError,
  [Code.Unavailable]: UnavailableError,
  [Code.NotFound]: NotFoundError,
  [Code.Unauthenticated]: UnauthenticatedError,
  [Code.PermissionDenied]: PermissionDeniedError,
  [Code.DeadlineExceeded]: DeadlineExceededError,
  [Code.Aborted]: AbortedError,
  [Code.Canceled]: CancelledError,
  [Code.Unimplemented]: UnimplementedError,
  [Code.AlreadyExists]: ConflictError,
  [Code.Internal]: InternalError,
};

/** Turns anything a call threw into a TokenspoutError of the matching class. */
export function decodeError(error: unknown): TokenspoutError {
  if (error instanceof TokenspoutError) return error;
  const connectError = ConnectError.from(error);
  const ErrorClass = classes[connectError.code] ?? TokenspoutError;
  return new ErrorClass(connectError);
}
