// Typed errors decoded from the google.rpc details the server sends
// (ErrorInfo always, BadRequest and RetryInfo where they apply).
import { Code, ConnectError } from "@connectrpc/connect";
import { BadRequestSchema, ErrorInfoSchema, RetryInfoSchema } from "./gen/google/rpc/error_details_pb.js";

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
