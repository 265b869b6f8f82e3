// A small typed wrapper over the dyngen.v1.Generator stub that @grpc/proto-loader builds from
// protos/ at run time. The request and event types are generated from the same .proto
// (`npm run gen-types`, into src/generated/), so a field the contract lacks does not compile.
import * as path from "node:path";
import * as grpc from "@grpc/grpc-js";
import * as protoLoader from "@grpc/proto-loader";

import type { ProtoGrpcType } from "./generated/generator";
import type { AdapterInfo__Output } from "./generated/dyngen/v1/AdapterInfo";
import type { ChatMessage } from "./generated/dyngen/v1/ChatMessage";
import type { EnqueueResponse__Output } from "./generated/dyngen/v1/EnqueueResponse";
import type { GenerateEvent__Output } from "./generated/dyngen/v1/GenerateEvent";
import type { GenerateRequest } from "./generated/dyngen/v1/GenerateRequest";
import type { GeneratorClient } from "./generated/dyngen/v1/Generator";
import type { JobFinished__Output } from "./generated/dyngen/v1/JobFinished";
import type { ModelInfo__Output } from "./generated/dyngen/v1/ModelInfo";
import type { TokenizeRequest } from "./generated/dyngen/v1/TokenizeRequest";
import { AFFINITY_HEADER, affinityKey, DEFAULT_AFFINITY_CHARS } from "./affinity";
import { markStreamCut } from "./errors";
import { RequestRanges } from "./ranges";

export type { GenerateEvent__Output as GenerateEvent } from "./generated/dyngen/v1/GenerateEvent";
export type { GenerateRequest } from "./generated/dyngen/v1/GenerateRequest";
export type { JobFinished__Output as JobFinished } from "./generated/dyngen/v1/JobFinished";
export type { ModelInfo__Output as ModelInfo } from "./generated/dyngen/v1/ModelInfo";
export type { AdapterInfo__Output as AdapterInfo } from "./generated/dyngen/v1/AdapterInfo";

// The options the generated types assume: field names as in the .proto, 64-bit integers as
// strings, enums as their names, defaults filled in, `event`/`prompt` naming the set oneof member.
export const LOADER_OPTIONS: protoLoader.Options = {
  keepCase: true,
  longs: String,
  enums: String,
  defaults: true,
  oneofs: true,
};

// protos/ of the repository this package sits in (dist/src/ -> clients/node -> repository root).
export function defaultProtoPath(): string {
  return path.resolve(__dirname, "..", "..", "..", "..", "protos", "dyngen", "v1", "generator.proto");
}

export interface ClientOptions {
  readonly credentials?: grpc.ChannelCredentials; // default: plaintext
  readonly token?: string; // bearer token sent with every call
  // Generate and Enqueue carry the prompt's prefix-affinity key (null: no key).
  readonly affinityChars?: number | null; // default DEFAULT_AFFINITY_CHARS
  readonly protoPath?: string; // default: defaultProtoPath()
  // Times a call refused with a retry delay (RESOURCE_EXHAUSTED, UNAVAILABLE) is tried again after
  // that delay: 0 to MAX_RETRIES, default 0 (never). See retryServiceConfig.
  readonly retries?: number;
}

export const MAX_RETRIES = 4; // gRPC's retry policy allows at most 5 attempts of a call

// gRPC's service config for `retries` more attempts of every Generator call refused with
// RESOURCE_EXHAUSTED or UNAVAILABLE, each after the delay the server gives (its RetryInfo, sent too as
// gRPC's retry pushback). A stream is retried only before its first event, so no event comes twice;
// a refusal without a delay (a client-side limit) backs off from 1 s.
export function retryServiceConfig(retries: number): string {
  if (!Number.isInteger(retries) || retries < 0 || retries > MAX_RETRIES) {
    throw new RangeError(`retries must be an integer in [0, ${MAX_RETRIES}], got ${retries}`);
  }
  const retryPolicy = {
    maxAttempts: retries + 1,
    initialBackoff: "1s",
    maxBackoff: "30s",
    backoffMultiplier: 2,
    retryableStatusCodes: ["RESOURCE_EXHAUSTED", "UNAVAILABLE"],
  };
  return JSON.stringify({ methodConfig: [{ name: [{ service: "dyngen.v1.Generator" }], retryPolicy }] });
}

export interface CallOptions {
  readonly deadline?: grpc.Deadline;
}

// One user message, rendered with the model's chat template.
export function chat(text: string): GenerateRequest["chat"] {
  const message: ChatMessage = { role: "user", content: text };
  return { messages: [message] };
}

export interface Result {
  readonly jobId: string;
  readonly text: string;
  readonly tokenIds: readonly number[];
  readonly finished: JobFinished__Output | null; // null: the stream ended without a finish event
}

// A whole job's outcome from the events of its stream.
export async function collect(
  events: AsyncIterable<GenerateEvent__Output> | Iterable<GenerateEvent__Output>,
): Promise<Result> {
  let jobId = "";
  let text = "";
  const tokenIds: number[] = [];
  let finished: JobFinished__Output | null = null;
  for await (const event of events) {
    jobId = event.job_id;
    if (event.delta) {
      text += event.delta.text;
      tokenIds.push(...event.delta.token_ids);
    } else if (event.finished) {
      text += event.finished.text;
      finished = event.finished;
    }
  }
  return { jobId, text, tokenIds, finished };
}

export class DyngenClient {
  private readonly stub: GeneratorClient;
  private readonly metadata: grpc.Metadata;
  private readonly affinityChars: number | null;
  private readonly ranges: RequestRanges;

  constructor(target: string, options: ClientOptions = {}) {
    const protoPath = options.protoPath ?? defaultProtoPath();
    const definition = protoLoader.loadSync(protoPath, LOADER_OPTIONS);
    this.ranges = new RequestRanges(protoPath);
    const proto = grpc.loadPackageDefinition(definition) as unknown as ProtoGrpcType;
    const retries = options.retries ?? 0;
    const channelOptions: grpc.ChannelOptions =
      retries > 0 ? { "grpc.enable_retries": 1, "grpc.service_config": retryServiceConfig(retries) } : {};
    this.stub = new proto.dyngen.v1.Generator(
      target,
      options.credentials ?? grpc.credentials.createInsecure(),
      channelOptions,
    );
    this.metadata = new grpc.Metadata();
    if (options.token) {
      this.metadata.set("authorization", `Bearer ${options.token}`);
    }
    this.affinityChars = options.affinityChars === undefined ? DEFAULT_AFFINITY_CHARS : options.affinityChars;
  }

  private jobMetadata(request: GenerateRequest): grpc.Metadata {
    const metadata = this.metadata.clone();
    const key = this.affinityChars === null ? undefined : affinityKey(request, this.affinityChars);
    if (key !== undefined) {
      metadata.set(AFFINITY_HEADER, key);
    }
    return metadata;
  }

  // A stream cut without a status (its replica died behind a balancer) fails as UNAVAILABLE,
  // reason REPLICA_LOST: the error is rewritten before any listener of the caller sees it.
  private static marked<T>(call: grpc.ClientReadableStream<T>): grpc.ClientReadableStream<T> {
    call.prependListener("error", markStreamCut);
    return call;
  }

  // The job's events; `call.cancel()` (or breaking out of a for-await loop) cancels the job.
  // An integer field outside its type's range (a negative max_new_tokens, say) throws a RangeError
  // naming it, before anything is sent; enqueue and tokenize reject with it.
  generate(request: GenerateRequest, options: CallOptions = {}): grpc.ClientReadableStream<GenerateEvent__Output> {
    this.ranges.check("dyngen.v1.GenerateRequest", request);
    return DyngenClient.marked(this.stub.Generate(request, this.jobMetadata(request), options));
  }

  stream(jobId: string, options: CallOptions = {}): grpc.ClientReadableStream<GenerateEvent__Output> {
    return DyngenClient.marked(this.stub.Stream({ job_id: jobId }, this.metadata.clone(), options));
  }

  enqueue(request: GenerateRequest, options: CallOptions = {}): Promise<EnqueueResponse__Output> {
    return new Promise((resolve, reject) => {
      this.ranges.check("dyngen.v1.GenerateRequest", request); // a RangeError rejects the promise
      this.stub.Enqueue(request, this.jobMetadata(request), options, (error, response) =>
        error || !response ? reject(error) : resolve(response),
      );
    });
  }

  cancel(jobId: string, options: CallOptions = {}): Promise<void> {
    return new Promise((resolve, reject) => {
      this.stub.Cancel({ job_id: jobId }, this.metadata.clone(), options, (error) => (error ? reject(error) : resolve()));
    });
  }

  modelInfo(options: CallOptions = {}): Promise<ModelInfo__Output> {
    return new Promise((resolve, reject) => {
      this.stub.GetModelInfo({}, this.metadata.clone(), options, (error, response) =>
        error || !response ? reject(error) : resolve(response),
      );
    });
  }

  tokenize(request: TokenizeRequest, options: CallOptions = {}): Promise<number[]> {
    return new Promise((resolve, reject) => {
      this.ranges.check("dyngen.v1.TokenizeRequest", request); // a RangeError rejects the promise
      this.stub.Tokenize(request, this.metadata.clone(), options, (error, response) =>
        error || !response ? reject(error) : resolve(response.token_ids),
      );
    });
  }

  // Loads a LoRA adapter (a PEFT folder on the server's disk) for requests to name in `adapter`.
  loadAdapter(name: string, adapterPath: string, options: CallOptions = {}): Promise<AdapterInfo__Output> {
    return new Promise((resolve, reject) => {
      this.stub.LoadAdapter({ name, path: adapterPath }, this.metadata.clone(), options, (error, response) =>
        error || !response ? reject(error) : resolve(response),
      );
    });
  }

  // Unloads an adapter: FAILED_PRECONDITION (reason ADAPTER_IN_USE) while jobs run with it.
  unloadAdapter(name: string, options: CallOptions = {}): Promise<void> {
    return new Promise((resolve, reject) => {
      this.stub.UnloadAdapter({ name }, this.metadata.clone(), options, (error) => (error ? reject(error) : resolve()));
    });
  }

  // The adapters this caller can name: the server's own (shared) and its tenant's.
  listAdapters(options: CallOptions = {}): Promise<AdapterInfo__Output[]> {
    return new Promise((resolve, reject) => {
      this.stub.ListAdapters({}, this.metadata.clone(), options, (error, response) =>
        error || !response ? reject(error) : resolve(response.adapters),
      );
    });
  }

  close(): void {
    this.stub.close();
  }
}
