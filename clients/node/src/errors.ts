// The google.rpc.Status a failed call carries in its `grpc-status-details-bin` trailer, decoded
// into typed values: the reason (ErrorInfo), the fields to blame (BadRequest) and how long to
// wait before retrying (RetryInfo). docs/CONTRACT.md lists the reasons.
import * as grpc from "@grpc/grpc-js";
import * as protobuf from "protobufjs";

export const DETAILS_KEY = "grpc-status-details-bin";
export const DOMAIN = "dyngen.v1";

// ErrorInfo.reason in the dyngen.v1 domain (dyngen_client.errors.ErrorReason on the Python side).
export const ERROR_REASONS = [
  "MALFORMED_REQUEST",
  "LIMIT_EXCEEDED",
  "INVALID_ARGUMENT",
  "PROMPT_TOO_LONG",
  "QUEUE_FULL",
  "TOO_MANY_STREAMS",
  "ENGINE_BUSY",
  "ENGINE_UNAVAILABLE",
  "DRAINING",
  "JOB_NOT_FOUND",
  "JOB_ALREADY_STREAMED",
  "UNAUTHENTICATED",
  "JOB_FAILED",
  "REPLICA_LOST", // set by the clients, never the server: the stream ended without a status
  "ADAPTER_NOT_FOUND",
  "ADAPTER_EXISTS",
  "ADAPTER_IN_USE",
  "ADAPTER_LIMIT",
  "PRIORITY_LIMIT",
  "ADAPTER_PATH_REFUSED",
  "ADAPTER_LOADING_OFF",
  "TENANT_ADAPTER_LIMIT",
  // the gateway's worker contract:
  "UNSUPPORTED", // an RPC this server does not provide (UNIMPLEMENTED)
  "REQUEST_ID_IN_USE", // the tenant's request_id is running already (ALREADY_EXISTS)
  "KV_EVENTS_GONE", // the KV events asked for are no longer kept: subscribe from 0
  "NOT_PERMITTED", // an RPC not served with authentication on (PERMISSION_DENIED)
] as const;
export type ErrorReason = (typeof ERROR_REASONS)[number];

export interface FieldViolation {
  readonly field: string; // a path into the request, e.g. "stop_strings[3]"
  readonly description: string;
}

export interface ErrorDetails {
  readonly code: grpc.status;
  readonly codeName: string; // "RESOURCE_EXHAUSTED", ...
  readonly message: string;
  readonly reason: ErrorReason | undefined; // undefined: no ErrorInfo, or a reason this client does not know
  readonly fieldViolations: readonly FieldViolation[];
  readonly retryDelaySeconds: number | undefined; // from RetryInfo
}

// The wire schema of the google.rpc messages read here (field numbers are the contract).
const root = protobuf.Root.fromJSON({
  nested: {
    google: {
      nested: {
        protobuf: {
          nested: {
            Any: { fields: { type_url: { type: "string", id: 1 }, value: { type: "bytes", id: 2 } } },
            Duration: { fields: { seconds: { type: "int64", id: 1 }, nanos: { type: "int32", id: 2 } } },
          },
        },
        rpc: {
          nested: {
            Status: {
              fields: {
                code: { type: "int32", id: 1 },
                message: { type: "string", id: 2 },
                details: { rule: "repeated", type: "google.protobuf.Any", id: 3 },
              },
            },
            ErrorInfo: { fields: { reason: { type: "string", id: 1 }, domain: { type: "string", id: 2 } } },
            BadRequest: {
              fields: { field_violations: { rule: "repeated", type: "FieldViolation", id: 1 } },
              nested: {
                FieldViolation: {
                  fields: { field: { type: "string", id: 1 }, description: { type: "string", id: 2 } },
                },
              },
            },
            RetryInfo: { fields: { retry_delay: { type: "google.protobuf.Duration", id: 1 } } },
          },
        },
      },
    },
  },
});

const STATUS = root.lookupType("google.rpc.Status");
const ERROR_INFO = root.lookupType("google.rpc.ErrorInfo");
const BAD_REQUEST = root.lookupType("google.rpc.BadRequest");
const RETRY_INFO = root.lookupType("google.rpc.RetryInfo");
const TYPE_PREFIX = "type.googleapis.com/";

interface AnyMessage {
  type_url: string;
  value: Uint8Array;
}

function decoded<T>(type: protobuf.Type, bytes: Uint8Array): T {
  return type.toObject(type.decode(bytes), { longs: Number, defaults: true }) as T;
}

function isErrorReason(text: string): text is ErrorReason {
  return (ERROR_REASONS as readonly string[]).includes(text);
}

export function isServiceError(error: unknown): error is grpc.ServiceError {
  return error instanceof Error && "code" in error && "metadata" in error;
}

// The typed details of a failed call (the status alone when it carries no trailer).
export function errorDetails(error: grpc.ServiceError): ErrorDetails {
  let reason: ErrorReason | undefined;
  let retryDelaySeconds: number | undefined;
  const fieldViolations: FieldViolation[] = [];
  const raw = error.metadata?.get(DETAILS_KEY)[0];
  if (raw instanceof Uint8Array) {
    const status = decoded<{ details: AnyMessage[] }>(STATUS, raw);
    for (const detail of status.details) {
      switch (detail.type_url.slice(TYPE_PREFIX.length)) {
        case "google.rpc.ErrorInfo": {
          const info = decoded<{ reason: string; domain: string }>(ERROR_INFO, detail.value);
          reason = info.domain === DOMAIN && isErrorReason(info.reason) ? info.reason : undefined;
          break;
        }
        case "google.rpc.BadRequest": {
          const bad = decoded<{ field_violations: FieldViolation[] }>(BAD_REQUEST, detail.value);
          fieldViolations.push(...bad.field_violations.map((v) => ({ field: v.field, description: v.description })));
          break;
        }
        case "google.rpc.RetryInfo": {
          const retry = decoded<{ retry_delay: { seconds: number; nanos: number } }>(RETRY_INFO, detail.value);
          retryDelaySeconds = retry.retry_delay.seconds + retry.retry_delay.nanos / 1e9;
          break;
        }
        default:
          break; // a detail this client does not read
      }
    }
  }
  return {
    code: error.code,
    codeName: grpc.status[error.code] ?? String(error.code),
    message: error.details,
    reason,
    fieldViolations,
    retryDelaySeconds,
  };
}

// A call that ended without a gRPC status: how a balancer ends a stream whose replica died
// (HAProxy 2.6 closes it without trailers; grpc-js then reports INTERNAL "Received RST_STREAM
// with code 0 (Call ended without gRPC status)"). Every status the server raises on purpose
// carries the details trailer; this one carries none.
export function isStreamCut(error: grpc.ServiceError): boolean {
  return (
    (error.code === grpc.status.INTERNAL || error.code === grpc.status.UNKNOWN) &&
    error.metadata?.get(DETAILS_KEY).length === 0 &&
    /^Received RST_STREAM with code \d+/.test(error.details)
  );
}

// Rewrites a cut stream's error in place as the status the replica could not send: UNAVAILABLE,
// reason REPLICA_LOST, retry at once (the job is gone; run it again).
export function markStreamCut(error: Error): void {
  if (!isServiceError(error) || !isStreamCut(error)) {
    return;
  }
  const message = `the replica running this call went away mid-stream (${error.details})`;
  const pack = (type: protobuf.Type, value: object): AnyMessage => ({
    type_url: TYPE_PREFIX + type.fullName.slice(1),
    value: type.encode(type.fromObject(value)).finish(),
  });
  const status = STATUS.encode(
    STATUS.fromObject({
      code: grpc.status.UNAVAILABLE,
      message,
      details: [
        pack(ERROR_INFO, { reason: "REPLICA_LOST", domain: DOMAIN }),
        pack(RETRY_INFO, { retry_delay: { seconds: 0, nanos: 0 } }),
      ],
    }),
  ).finish();
  const metadata = error.metadata ?? new grpc.Metadata();
  metadata.set(DETAILS_KEY, Buffer.from(status));
  Object.assign(error, {
    code: grpc.status.UNAVAILABLE,
    details: message,
    message: `${grpc.status.UNAVAILABLE} UNAVAILABLE: ${message}`,
    metadata,
  });
}
