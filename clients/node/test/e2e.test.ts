// End to end against a real `dyngen serve` started by tests/test_client_node.py, which passes its
// address in DYNGEN_TARGET and starts it with --max-streams 1 so a second open stream is refused.
// The tests run in order; the one that leaves a stream cancelled (freed asynchronously) is last.
import assert from "node:assert/strict";
import { after, test } from "node:test";

import { chat, collect, DyngenClient, errorDetails, isServiceError, type GenerateEvent } from "../src/index";

const target = process.env.DYNGEN_TARGET;
if (!target) {
  throw new Error("DYNGEN_TARGET (host:port of a running dyngen server) is not set");
}
const client = new DyngenClient(target);
after(() => client.close());

const LONG = { chat: chat("Tell me a very long story."), max_new_tokens: 4000, ignore_eos: true };

test("streams a chat completion", async () => {
  const events: GenerateEvent[] = [];
  for await (const event of client.generate({ chat: chat("What is the capital of France?"), max_new_tokens: 16, ignore_eos: true })) {
    events.push(event);
  }
  assert.equal(events[0]?.event, "started");
  assert.ok(events.some((e) => e.event === "delta" && (e.delta?.token_ids.length ?? 0) > 0));
  const result = await collect(events);
  assert.equal(result.finished?.stop_reason, "STOP_REASON_MAX_NEW_TOKENS");
  assert.equal(result.finished?.new_tokens, 16);
  assert.equal(result.tokenIds.length, 16);
  assert.match(result.jobId, /^[0-9a-f]{32}$/);
});

test("runs, loads, lists and unloads LoRA adapters", async () => {
  const folder = process.env.DYNGEN_ADAPTER_PATH; // a folder's name inside the server's --adapter-dir
  assert.ok(folder, "DYNGEN_ADAPTER_PATH is not set");
  const prompt = { token_ids: { ids: [11, 12, 13, 14, 15] }, max_new_tokens: 8, ignore_eos: true };
  const tokens = async (adapter: string): Promise<readonly number[]> => (await collect(client.generate({ ...prompt, adapter }))).tokenIds;
  assert.deepEqual((await client.listAdapters()).map((a) => [a.name, a.shared]), [["shared", true]]);
  const base = await tokens("");
  const shared = await tokens("shared");
  assert.notDeepEqual(shared, base);
  const info = await client.loadAdapter("mine", folder);
  assert.equal(info.name, "mine");
  assert.deepEqual((await client.listAdapters()).map((a) => a.name), ["mine", "shared"]);
  assert.deepEqual(await tokens("mine"), shared); // the same folder as "shared"
  await client.unloadAdapter("mine");
  await assert.rejects(tokens("mine"), (error: unknown) => {
    assert.ok(isServiceError(error));
    assert.equal(error.code, 5); // NOT_FOUND
    assert.equal(errorDetails(error).reason, "ADAPTER_NOT_FOUND");
    return true;
  });
});

test("cancels an enqueued job while streaming it", async () => {
  const { job_id } = await client.enqueue(LONG);
  let deltas = 0;
  let stopReason = "";
  for await (const event of client.stream(job_id) as AsyncIterable<GenerateEvent>) {
    if (event.delta && ++deltas === 3) {
      await client.cancel(job_id);
    }
    if (event.finished) {
      stopReason = event.finished.stop_reason;
    }
  }
  assert.equal(stopReason, "STOP_REASON_CANCELLED");
  assert.ok(deltas < 200, `${deltas} deltas after the cancel`);
  await assert.rejects(client.cancel(job_id), (error: unknown) => {
    assert.ok(isServiceError(error));
    const details = errorDetails(error);
    assert.equal(details.codeName, "NOT_FOUND");
    assert.equal(details.reason, "JOB_NOT_FOUND");
    return true;
  });
});

test("a request past a limit is INVALID_ARGUMENT naming the field", async () => {
  const tooMany = Array.from({ length: 17 }, (_, i) => `stop${i}`);
  await assert.rejects(collect(client.generate({ text: "Hi", stop_strings: tooMany })), (error: unknown) => {
    assert.ok(isServiceError(error));
    const details = errorDetails(error);
    assert.equal(details.codeName, "INVALID_ARGUMENT");
    assert.equal(details.reason, "LIMIT_EXCEEDED");
    assert.deepEqual(
      details.fieldViolations.map((v) => v.field),
      ["stop_strings"],
    );
    assert.equal(details.retryDelaySeconds, undefined);
    return true;
  });
});

test("an integer field outside its type's range is refused before sending, naming its path", async () => {
  assert.throws(() => client.generate({ text: "Hi", max_new_tokens: -1 }), /max_new_tokens must be an integer in \[0, 4294967295\]/);
  assert.throws(
    () => client.generate({ text: "Hi", sampling: { top_k: 1.5 } }),
    /sampling\.top_k must be an integer/,
  );
  assert.throws(
    () => client.generate({ token_ids: { ids: [1, -2] }, max_new_tokens: 4 }),
    /token_ids\.ids\[1\] must be an integer/,
  );
  assert.throws(() => client.generate({ text: "Hi", priority: 2 ** 31 }), /priority must be an integer in \[-2147483648/);
  await assert.rejects(client.enqueue({ text: "Hi", min_new_tokens: -3 }), /min_new_tokens must be an integer/);
  assert.throws(() => client.generate({ text: "Hi", sampling: { seed: "-1" } }), /sampling\.seed/);
});

test("carries priority and guidance; a bad guidance scale is INVALID_ARGUMENT naming it", async () => {
  const result = await collect(client.generate({ text: "Hi", max_new_tokens: 3, ignore_eos: true, priority: 5 }));
  assert.equal(result.finished?.new_tokens, 3);
  const guided = { text: "Hi", priority: -2, guidance: { scale: 101, text: "dull" } };
  await assert.rejects(collect(client.generate(guided)), (error: unknown) => {
    assert.ok(isServiceError(error));
    const details = errorDetails(error);
    assert.equal(details.codeName, "INVALID_ARGUMENT");
    assert.deepEqual(
      details.fieldViolations.map((v) => v.field),
      ["guidance.scale"],
    );
    return true;
  });
});

test("carries prompt embeddings as float32 bytes; rows of the wrong width are INVALID_ARGUMENT naming data", async () => {
  const { hidden_size } = await client.modelInfo();
  assert.ok(hidden_size > 0);
  const vectors = (rows: number, width: number): Buffer => {
    const data = Buffer.alloc(rows * width * 4);
    for (let i = 0; i < rows * width; i++) {
      data.writeFloatLE(Math.sin(i) / 4, i * 4);
    }
    return data;
  };
  const request = (width: number) => ({
    token_ids: { ids: [1, 300, 40, 41] },
    max_new_tokens: 4000,
    ignore_eos: true,
    embeddings: [{ data: vectors(3, width), rows: 3, placeholder_token_id: 300 }],
  });
  const { job_id, prompt_tokens } = await client.enqueue(request(hidden_size));
  assert.equal(prompt_tokens, 6); // the placeholder expanded to the 3 rows
  await client.cancel(job_id);
  assert.equal((await collect(client.stream(job_id))).finished?.stop_reason, "STOP_REASON_CANCELLED");
  await assert.rejects(client.enqueue(request(hidden_size + 1)), (error: unknown) => {
    assert.ok(isServiceError(error));
    const details = errorDetails(error);
    assert.equal(details.codeName, "INVALID_ARGUMENT");
    assert.deepEqual(
      details.fieldViolations.map((v) => v.field),
      ["embeddings[0].data"],
    );
    return true;
  });
});

test("a client with retries waits the server's delay and gets in once a stream closes", async () => {
  const open = client.generate(LONG);
  await new Promise<GenerateEvent>((resolve, reject) => {
    open.once("data", resolve);
    open.once("error", reject);
  });
  const patient = new DyngenClient(target, { retries: 4 });
  setTimeout(() => {
    open.on("error", () => {}); // the CANCELLED status of our own cancel
    open.cancel();
  }, 300);
  try {
    const started = Date.now();
    const result = await collect(patient.generate({ token_ids: { ids: [11, 12, 13] }, max_new_tokens: 2, ignore_eos: true }));
    assert.equal(result.finished?.new_tokens, 2);
    assert.ok(Date.now() - started >= 100); // refused at first (the only stream was open), then let in
  } finally {
    patient.close();
  }
});

test("a stream past the server's limit is RESOURCE_EXHAUSTED with a RetryInfo", async () => {
  const open = client.generate(LONG);
  const first = await new Promise<GenerateEvent>((resolve, reject) => {
    open.once("data", resolve);
    open.once("error", reject);
  });
  assert.equal(first.event, "started");
  try {
    await assert.rejects(collect(client.generate(LONG)), (error: unknown) => {
      assert.ok(isServiceError(error));
      const details = errorDetails(error);
      assert.equal(details.codeName, "RESOURCE_EXHAUSTED");
      assert.equal(details.reason, "TOO_MANY_STREAMS");
      assert.ok(details.retryDelaySeconds !== undefined && details.retryDelaySeconds > 0);
      return true;
    });
  } finally {
    open.on("error", () => {}); // the CANCELLED status of our own cancel
    open.cancel();
  }
});
