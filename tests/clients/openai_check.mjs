// The official `openai` Node client against prefixlb in front of two mock engines.
//
//     NODE_PATH=target/ci-node/node_modules node tests/clients/openai_check.mjs target/debug/prefixlb
//
// The same checks as openai_check.py, as a Node user sees them: chat completions with
// and without streaming, completions, models, embeddings, an audio transcription
// (a multipart upload), a streamed tool call, a
// Responses API conversation chained by previous_response_id (read, then deleted), and our
// errors as the client's exception classes (404 -> NotFoundError, 401 ->
// AuthenticationError, 503 on saturation -> APIError with status 503). Starts its own
// engines and balancer on loopback ports chosen by the OS; exits non-zero on the first
// failure.

import { spawn } from "node:child_process";
import { mkdtempSync, writeFileSync } from "node:fs";
import { createRequire } from "node:module";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createInterface } from "node:readline";

// Resolved from NODE_PATH (ES modules ignore it; require does not).
const OpenAI = createRequire(join(process.cwd(), "noop.js"))("openai");
const BIN = process.argv[2] ?? "target/debug/prefixlb";
const KEY = "sk-openai-check";
const procs = [];

/** Starts a prefixlb process; resolves to the addresses on its 'listening' line. */
function start(args, env = {}) {
  const p = spawn(BIN, args, {
    env: { ...process.env, RUST_LOG: "warn", ...env },
    stdio: ["ignore", "pipe", "ignore"],
  });
  procs.push(p);
  return new Promise((resolve, reject) => {
    const lines = createInterface({ input: p.stdout });
    lines.once("line", (line) => {
      const addrs = [...line.matchAll(/http:\/\/([0-9.]+:[0-9]+)/g)].map((m) => m[1]);
      addrs.length ? resolve(addrs) : reject(new Error(`no address in ${line}`));
    });
    p.once("exit", (code) => reject(new Error(`${args[0]} exited with ${code}`)));
  });
}

function check(name, cond, detail = "") {
  if (!cond) throw new Error(`${name}: ${JSON.stringify(detail)}`);
  console.log(`ok  ${name}`);
}

async function expectError(name, promise, cls, status) {
  try {
    await promise;
  } catch (err) {
    check(name, err instanceof cls && err.status === status, `${err?.constructor?.name} ${err?.status}`);
    return err;
  }
  check(name, false, "no exception");
}

async function main() {
  const engines = [];
  for (const i of [0, 1]) {
    const [addr] = await start(["mock-engine", "--listen", "127.0.0.1:0", "--id", `e${i}`, "--decode-ms-per-token", "5"]);
    engines.push(addr);
  }
  const nodes = engines.map((a, i) => `[[pools.nodes]]\nid = "n${i}"\nurl = "http://${a}"\n`).join("");
  const path = join(mkdtempSync(join(tmpdir(), "prefixlb-node-")), "prefixlb.toml");
  writeFileSync(
    path,
    '[server]\nlisten = "127.0.0.1:0"\nadmin_listen = "127.0.0.1:0"\n' +
      '[routing]\nmax_in_flight = 1\nwhen_saturated = "reject"\n' +
      '[auth]\napi_keys_env = "OPENAI_CHECK_KEYS"\n' +
      `[[pools]]\nname = "mock"\nmodels = ["mock"]\n${nodes}`,
  );
  const [lb] = await start(["serve", "--config", path], { OPENAI_CHECK_KEYS: KEY });
  const client = new OpenAI({ baseURL: `http://${lb}/v1`, apiKey: KEY, maxRetries: 0, timeout: 20000 });
  const hi = [{ role: "user", content: "hi" }];

  const r = await client.chat.completions.create({ model: "mock", messages: hi, max_tokens: 4 });
  check("chat.completions.create", r.choices[0].message.content.trim() !== "" && r.usage.prompt_tokens > 0, r);

  let text = "";
  let usage = null;
  const stream = await client.chat.completions.create({
    model: "mock",
    messages: hi,
    max_tokens: 4,
    stream: true,
    stream_options: { include_usage: true },
  });
  for await (const chunk of stream) {
    text += chunk.choices[0]?.delta?.content ?? "";
    usage = chunk.usage ?? usage;
  }
  check("chat.completions.create({stream: true})", text.trim().split(/\s+/).length === 4 && usage, { text, usage });

  const c = await client.completions.create({ model: "mock", prompt: "Once upon a time", max_tokens: 3 });
  check("completions.create", c.choices[0].text.trim() !== "", c);

  const models = [];
  for await (const m of client.models.list()) models.push(m.id);
  check("models.list", models.length === 1 && models[0] === "mock", models);

  const e = await client.embeddings.create({ model: "mock", input: ["a", "b"] });
  check("embeddings.create", e.data.length === 2 && e.data[0].embedding.length === 8, e);

  // Audio: a multipart upload as the Node client writes it; the mock engine's
  // "transcript" says what it received (model, file length, digest).
  const audio = Buffer.concat([Buffer.from("RIFF"), Buffer.alloc(16000), Buffer.from([...Array(256).keys()])]);
  const said = `model=mock bytes=${audio.length} `;
  const file = await OpenAI.toFile(audio, "speech.wav", { type: "audio/wav" });
  const t = await client.audio.transcriptions.create({ model: "mock", file, language: "en" });
  check("audio.transcriptions.create", t.text.startsWith(said), t);

  let name = "";
  let args = "";
  let finish = null;
  const tools = [{ type: "function", function: { name: "lookup", parameters: { type: "object" } } }];
  const calls = await client.chat.completions.create({
    model: "mock",
    messages: [{ role: "user", content: "x" }],
    tools,
    stream: true,
  });
  for await (const chunk of calls) {
    const choice = chunk.choices[0];
    if (!choice) continue;
    for (const call of choice.delta.tool_calls ?? []) {
      name += call.function?.name ?? "";
      args += call.function?.arguments ?? "";
    }
    finish = choice.finish_reason ?? finish;
  }
  check("a tool call in a stream", name === "lookup" && args === '{"x": 1}' && finish === "tool_calls", {
    name,
    args,
    finish,
  });

  // The Responses API, a conversation chained by previous_response_id: each engine keeps
  // its own responses, so every turn must reach the one that answered the last.
  const r1 = await client.responses.create({
    model: "mock",
    input: "tell me about caches ".repeat(30),
    max_output_tokens: 4,
  });
  check("responses.create", r1.output_text.trim() !== "" && r1.usage.input_tokens > 0, r1);
  let r2 = null;
  const events = await client.responses.create({
    model: "mock",
    input: "and then? ".repeat(10),
    previous_response_id: r1.id,
    max_output_tokens: 4,
    stream: true,
  });
  for await (const event of events) {
    if (event.type === "response.completed") r2 = event.response;
  }
  check(
    "responses.create({stream: true, previous_response_id})",
    r2 && r2.usage.input_tokens_details.cached_tokens > 0,
    r2,
  );
  const got = await client.responses.retrieve(r2.id);
  check("responses.retrieve", got.id === r2.id && got.status === "completed", got);
  await client.responses.delete(r2.id);
  await expectError(
    "responses.retrieve after delete -> NotFoundError",
    client.responses.retrieve(r2.id),
    OpenAI.NotFoundError,
    404,
  );

  await expectError(
    "404 -> NotFoundError",
    client.chat.completions.create({ model: "no-such-model", messages: hi }),
    OpenAI.NotFoundError,
    404,
  );
  const wrong = new OpenAI({ baseURL: `http://${lb}/v1`, apiKey: "sk-wrong", maxRetries: 0 });
  await expectError("401 -> AuthenticationError", wrong.models.list(), OpenAI.AuthenticationError, 401);

  // Saturation: both nodes (cap 1 each) busy with long streams; the next is refused.
  const holders = [0, 1].map((i) =>
    client.chat.completions.create(
      { model: "mock", messages: [{ role: "user", content: `hold-${i}` }], max_tokens: 400, stream: true },
      { headers: { "x-session-id": `hold-${i}` } },
    ),
  );
  const held = await Promise.all(holders);
  const iterators = held.map((s) => s[Symbol.asyncIterator]());
  await Promise.all(iterators.map((it) => it.next()));
  const busy = await expectError(
    "503 -> APIError",
    client.chat.completions.create({ model: "mock", messages: [{ role: "user", content: "one more" }], max_tokens: 1 }),
    OpenAI.APIError,
    503,
  );
  check("503 carries retry-after", busy.headers?.get?.("retry-after") ?? busy.headers?.["retry-after"], busy.headers);
  for (const it of iterators) {
    while (!(await it.next()).done);
  }
  console.log("openai node client check: all passed");
}

try {
  await main();
} catch (err) {
  console.error(`FAILED: ${err?.stack ?? err}`);
  process.exitCode = 1;
} finally {
  for (const p of procs) p.kill();
}
