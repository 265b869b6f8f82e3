// The scale-out contract (docs/SCALING.md): the prefix-affinity key's test vectors, and a stream
// cut without a gRPC status, served by tests/stream_cut_server.py (DYNGEN_CUT_TARGET), failing
// as UNAVAILABLE / REPLICA_LOST.
import assert from "node:assert/strict";
import { test } from "node:test";

import { affinityKey, collect, DyngenClient, errorDetails, isServiceError } from "../src/index";

test("the affinity key matches the documented test vectors", () => {
  assert.equal(affinityKey({ text: "Hello" }), "185f8db32271fe25");
  const terse = { messages: [{ role: "system", content: "You are terse." }, { role: "user", content: "Hi" }] };
  assert.equal(affinityKey({ chat: terse }), "c29e6f9b1a47d500");
  assert.equal(affinityKey({ token_ids: { ids: [1, 2, 3] } }), "8a2ddba46c83c920");
  // Only the first `chars` code points count (an emoji is one).
  assert.equal(affinityKey({ text: "😀bc" }, 2), affinityKey({ text: "😀bd" }, 2));
  assert.notEqual(affinityKey({ text: "😀bc" }, 3), affinityKey({ text: "😀bd" }, 3));
  assert.throws(() => affinityKey({ text: "x" }, 0), RangeError);
});

test("a stream cut without a status fails as UNAVAILABLE, REPLICA_LOST", async () => {
  const target = process.env.DYNGEN_CUT_TARGET;
  assert.ok(target, "DYNGEN_CUT_TARGET (tests/stream_cut_server.py) is not set");
  const client = new DyngenClient(target);
  try {
    await assert.rejects(collect(client.generate({ text: "hi" })), (error: unknown) => {
      assert.ok(isServiceError(error));
      const details = errorDetails(error);
      assert.equal(details.codeName, "UNAVAILABLE");
      assert.equal(details.reason, "REPLICA_LOST");
      assert.equal(details.retryDelaySeconds, 0);
      assert.match(details.message, /went away mid-stream/);
      return true;
    });
  } finally {
    client.close();
  }
});
