// The prefix-affinity key (docs/SCALING.md): requests that share a prompt's start get the same
// key, so a balancer hashing on it sends them to the replica whose prefix cache holds that start.
// The same rule as dyngen_client.affinity, checked against the same test vectors.
import { createHash } from "node:crypto";

import type { GenerateRequest } from "./generated/dyngen/v1/GenerateRequest";

export const AFFINITY_HEADER = "x-dyngen-affinity";
export const DEFAULT_AFFINITY_CHARS = 2048;

// Step 1: the text whose leading characters make the key (undefined: the request has no prompt).
export function canonicalText(request: GenerateRequest): string | undefined {
  if (request.text !== undefined && request.text !== null) {
    return request.text;
  }
  if (request.chat) {
    return (request.chat.messages ?? []).map((m) => `${m.role ?? ""}\n${m.content ?? ""}\n`).join("");
  }
  if (request.token_ids) {
    return (request.token_ids.ids ?? []).map((t) => `${Number(t)} `).join("");
  }
  return undefined;
}

// Steps 2-3: the first `chars` code points, SHA-256 of their UTF-8 bytes, 16 lowercase hex digits.
export function affinityKey(request: GenerateRequest, chars: number = DEFAULT_AFFINITY_CHARS): string | undefined {
  if (!Number.isInteger(chars) || chars < 1) {
    throw new RangeError(`affinity chars must be an integer >= 1, got ${chars}`);
  }
  const text = canonicalText(request);
  if (text === undefined) {
    return undefined;
  }
  const head = Array.from(text).slice(0, chars).join("");
  return createHash("sha256").update(head, "utf8").digest("hex").slice(0, 16);
}
