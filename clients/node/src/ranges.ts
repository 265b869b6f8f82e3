// The integer fields of a request checked against their protobuf types before it is sent:
// protobufjs writes a negative number into a uint32 field as its two's complement (-1 reaches
// the server as 4294967295), so a caller's sign error would come back as a confusing refusal of a
// huge value, or not at all. A value outside its type's range is a RangeError naming its path.
import * as protobuf from "protobufjs";

const RANGES: Record<string, readonly [bigint, bigint]> = {
  uint32: [0n, 2n ** 32n - 1n],
  fixed32: [0n, 2n ** 32n - 1n],
  int32: [-(2n ** 31n), 2n ** 31n - 1n],
  sint32: [-(2n ** 31n), 2n ** 31n - 1n],
  sfixed32: [-(2n ** 31n), 2n ** 31n - 1n],
  uint64: [0n, 2n ** 64n - 1n],
  fixed64: [0n, 2n ** 64n - 1n],
  int64: [-(2n ** 63n), 2n ** 63n - 1n],
  sint64: [-(2n ** 63n), 2n ** 63n - 1n],
  sfixed64: [-(2n ** 63n), 2n ** 63n - 1n],
};

function asInteger(value: unknown): bigint | undefined {
  if (typeof value === "number") {
    return Number.isInteger(value) ? BigInt(value) : undefined;
  }
  if (typeof value === "bigint") {
    return value;
  }
  if (typeof value === "string" && /^-?\d+$/.test(value)) {
    return BigInt(value);
  }
  if (typeof value === "object" && value !== null && "low" in value && "high" in value) {
    return asInteger(String(value)); // a Long, as protobufjs takes 64-bit values too
  }
  return undefined;
}

function checkValue(field: protobuf.Field, value: unknown, path: string): void {
  if (value === undefined || value === null) {
    return;
  }
  const range = RANGES[field.type];
  if (range !== undefined) {
    const n = asInteger(value);
    if (n === undefined || n < range[0] || n > range[1]) {
      throw new RangeError(`${path} must be an integer in [${range[0]}, ${range[1]}] (${field.type}), got ${String(value)}`);
    }
  } else if (field.resolvedType instanceof protobuf.Type && typeof value === "object") {
    checkMessage(field.resolvedType, value as Record<string, unknown>, `${path}.`);
  }
}

// Throws a RangeError for the first integer field of `message` (a plain object of `type`, field
// names as in the .proto; `prefix` is its path in the request) outside its type's range; other
// mistakes are the server's to refuse.
export function checkMessage(type: protobuf.Type, message: Record<string, unknown>, prefix = ""): void {
  for (const field of type.fieldsArray) {
    const value = message[field.name];
    const path = prefix + field.name;
    if (field.repeated && Array.isArray(value)) {
      value.forEach((item: unknown, i) => checkValue(field, item, `${path}[${i}]`));
    } else if (!field.map) {
      checkValue(field, value, path);
    }
  }
}

// The request types of the contract, resolved once from the same .proto the stub is built from.
export class RequestRanges {
  private readonly root: protobuf.Root;

  constructor(protoPath: string) {
    this.root = new protobuf.Root().loadSync(protoPath, { keepCase: true }); // names as in the .proto
    this.root.resolveAll();
  }

  check(typeName: string, message: object): void {
    checkMessage(this.root.lookupType(typeName), message as Record<string, unknown>);
  }
}
