// @dyngen/client: a typed Node.js client of dyngen's gRPC contract (dyngen.v1.Generator).
export * from "./client";
export * from "./errors";
export * from "./affinity";
export * from "./ranges";
