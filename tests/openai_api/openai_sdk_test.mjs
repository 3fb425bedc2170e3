// The official `openai` npm SDK against Duet's OpenAI-compatible API (a running local cluster).
// Env: OPENAI_BASE_URL (…/v1), OPENAI_AUTH_BASE_URL (a router with --api-key test-key and
// --max-concurrent-requests 1, --max-queued-requests 0), OPENAI_DOWN_BASE_URL (a router none of whose workers is up),
// OPENAI_FAULT_BASE_URL (a router whose decode worker sends two tokens, then a message that is no
// GenerateResponse), MODEL_NAME.
import assert from 'node:assert/strict';
import { createRequire } from 'node:module';
import { passed, test } from './test_runner.mjs';

// tests/node holds the test dependencies (NODE_DEPS_DIR).
const require = createRequire(`${process.env.NODE_DEPS_DIR}/package.json`);
const OpenAI = require('openai');

const baseURL = process.env.OPENAI_BASE_URL;
const authBaseURL = process.env.OPENAI_AUTH_BASE_URL;
const downBaseURL = process.env.OPENAI_DOWN_BASE_URL;
const faultBaseURL = process.env.OPENAI_FAULT_BASE_URL;
const model = process.env.MODEL_NAME;
const client = new OpenAI({ baseURL, apiKey: 'unused', maxRetries: 0, timeout: 60000 });


async function expectError(cls, fn, status) {
  try {
    await fn();
  } catch (e) {
    assert.ok(e instanceof cls, `expected ${cls.name}, got ${e?.constructor?.name}: ${e?.message}`);
    if (status !== undefined) assert.equal(e.status, status);
    if (e.status) assert.equal(typeof e.error?.message, 'string', 'OpenAI error object with a message');
    return e;
  }
  assert.fail(`expected ${cls.name}, got success`);
}

const greedy = { temperature: 0, ignore_eos: true };

await test('models.list', async () => {
  const models = await client.models.list();
  assert.deepEqual(models.data.map((m) => m.id), [model]);
});

await test('completions: non-streaming', async () => {
  const r = await client.completions.create({ model, prompt: 'def fib(n):', max_tokens: 8, ...greedy });
  assert.equal(r.object, 'text_completion');
  assert.match(r.id, /^cmpl-/);
  assert.equal(r.model, model);
  assert.equal(typeof r.created, 'number');
  assert.equal(r.choices.length, 1);
  assert.equal(r.choices[0].finish_reason, 'length');
  assert.ok(r.choices[0].text.length > 0);
  assert.equal(r.usage.completion_tokens, 8);
  assert.ok(r.usage.prompt_tokens > 0);
  assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + 8);
});

await test('completions: streaming equals non-streaming (greedy), include_usage', async () => {
  const whole = await client.completions.create({ model, prompt: 'import os\n', max_tokens: 10, ...greedy });
  const stream = await client.completions.create({
    model, prompt: 'import os\n', max_tokens: 10, ...greedy, stream: true, stream_options: { include_usage: true },
  });
  let text = '';
  let finish = null;
  let usage = null;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      text += c.text;
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  assert.equal(text, whole.choices[0].text);
  assert.equal(finish, 'length');
  assert.deepEqual(usage, whole.usage);
});

await test('completions: n > 1 with seed, multiple prompts, token-id prompts', async () => {
  const r = await client.completions.create({ model, prompt: 'x = ', max_tokens: 6, n: 3, seed: 7, temperature: 1.0 });
  assert.equal(r.choices.length, 3);
  assert.deepEqual(r.choices.map((c) => c.index), [0, 1, 2]);
  const again = await client.completions.create({ model, prompt: 'x = ', max_tokens: 6, n: 3, seed: 7, temperature: 1.0 });
  assert.deepEqual(again.choices.map((c) => c.text), r.choices.map((c) => c.text), 'seeded choices are reproducible');
  const multi = await client.completions.create({ model, prompt: ['a', 'b'], max_tokens: 2, n: 2, ...greedy });
  assert.equal(multi.choices.length, 4);
  assert.equal(multi.usage.completion_tokens, 8);
  const tok = await fetch(baseURL.replace(/\/v1$/, '') + '/tokenize', {
    method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ prompt: 'def fib(n):' }),
  }).then((x) => x.json());
  const byIds = await client.completions.create({ model, prompt: tok.tokens, max_tokens: 8, ...greedy });
  const byText = await client.completions.create({ model, prompt: 'def fib(n):', max_tokens: 8, ...greedy });
  assert.equal(byIds.choices[0].text, byText.choices[0].text);
});

await test('completions: stop strings, echo, logprobs', async () => {
  const base = await client.completions.create({ model, prompt: 'def fib(n):', max_tokens: 16, ...greedy });
  const text = base.choices[0].text;
  const stop = text.slice(3, 5);
  assert.ok(stop.length === 2, 'need some generated text');
  const stopped = await client.completions.create({ model, prompt: 'def fib(n):', max_tokens: 16, temperature: 0, stop: [stop] });
  assert.equal(stopped.choices[0].finish_reason, 'stop');
  assert.ok(!stopped.choices[0].text.includes(stop), JSON.stringify(stopped.choices[0].text));
  assert.ok(text.startsWith(stopped.choices[0].text));
  // vLLM's stop_reason names the stop string; include_stop_str_in_output keeps it, streaming too.
  assert.equal(stopped.choices[0].stop_reason, stop);
  const kept = await client.completions.create({
    model, prompt: 'def fib(n):', max_tokens: 16, temperature: 0, stop: ['never', stop], include_stop_str_in_output: true,
  });
  assert.equal(kept.choices[0].text, stopped.choices[0].text + stop);
  assert.equal(kept.choices[0].stop_reason, stop);
  let streamedText = '';
  let last = null;
  for await (const chunk of await client.completions.create({
    model, prompt: 'def fib(n):', max_tokens: 16, temperature: 0, stop: [stop], include_stop_str_in_output: true, stream: true,
  })) {
    streamedText += chunk.choices[0]?.text ?? '';
    if (chunk.choices[0]?.finish_reason) last = chunk.choices[0];
  }
  assert.equal(streamedText, kept.choices[0].text);
  assert.equal(last.stop_reason, stop);
  assert.equal(base.choices[0].stop_reason, null);  // finished by length
  const echoed = await client.completions.create({ model, prompt: 'def fib(n):', max_tokens: 4, ...greedy, echo: true });
  assert.ok(echoed.choices[0].text.startsWith('def fib(n):'));
  const lp = await client.completions.create({ model, prompt: 'def fib(n):', max_tokens: 4, ...greedy, logprobs: 2 });
  const l = lp.choices[0].logprobs;
  assert.equal(l.tokens.length, 4);
  assert.equal(l.token_logprobs.length, 4);
  assert.ok(l.token_logprobs.every((x) => typeof x === 'number' && x <= 0));
  assert.equal(l.top_logprobs.length, 4);
  assert.ok(Object.keys(l.top_logprobs[0]).length >= 1);
  assert.equal(l.text_offset.length, 4);
  assert.equal(l.tokens.join(''), lp.choices[0].text);
});

await test('completions: echo + logprobs score the prompt; prompt_logprobs (vLLM)', async () => {
  const prompt = 'def fib(n):';
  const plain = await client.completions.create({ model, prompt, max_tokens: 4, ...greedy, logprobs: 2 });
  const r = await client.completions.create({ model, prompt, max_tokens: 4, ...greedy, echo: true, logprobs: 2 });
  const c = r.choices[0];
  assert.equal(c.text, prompt + plain.choices[0].text);
  const l = c.logprobs;
  const numPrompt = l.tokens.length - 4;
  assert.ok(numPrompt >= 2, `the prompt's tokens lead: ${JSON.stringify(l.tokens)}`);
  assert.equal(l.token_logprobs[0], null);  // the first token is not predicted
  assert.equal(l.top_logprobs[0], null);
  assert.ok(l.token_logprobs.slice(1).every((x) => typeof x === 'number' && x <= 0));
  assert.ok(l.top_logprobs.slice(1).every((t) => Object.keys(t).length === 2));
  assert.deepEqual(l.token_logprobs.slice(numPrompt), plain.choices[0].logprobs.token_logprobs);
  assert.equal(l.text_offset[0], 0);
  for (let i = 1; i < l.tokens.length; ++i) assert.equal(l.text_offset[i], l.text_offset[i - 1] + l.tokens[i - 1].length);
  // Streamed: the same tokens and logprobs, the prompt's in the first chunk.
  const tokens = [];
  const logprobs = [];
  for await (const chunk of await client.completions.create({
    model, prompt, max_tokens: 4, ...greedy, echo: true, logprobs: 2, stream: true,
  })) {
    const cl = chunk.choices[0]?.logprobs;
    if (cl) { tokens.push(...cl.tokens); logprobs.push(...cl.token_logprobs); }
  }
  assert.deepEqual(tokens, l.tokens);
  assert.deepEqual(logprobs, l.token_logprobs);
  // vLLM's prompt_logprobs: [null, {"<id>": {logprob, rank, decoded_token}}, ...], the same numbers.
  const p = await client.completions.create({ model, prompt, max_tokens: 1, ...greedy, prompt_logprobs: 2 });
  const pl = p.choices[0].prompt_logprobs;
  assert.equal(pl.length, numPrompt);
  assert.equal(pl[0], null);
  const ids = (await (await fetch(baseURL.replace(/\/v1$/, '/tokenize'), {
    method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify({ model, prompt }),
  })).json()).tokens;
  assert.equal(ids.length, numPrompt);
  for (let i = 1; i < numPrompt; ++i) {
    const own = pl[i][String(ids[i])];  // keyed by token id (JS orders such keys by value)
    assert.ok(own, `position ${i}: ${JSON.stringify(pl[i])}`);
    assert.equal(own.logprob, l.token_logprobs[i]);
    assert.equal(own.decoded_token, l.tokens[i]);
    assert.ok(Number.isInteger(own.rank) && own.rank >= 1);
    assert.ok(Object.keys(pl[i]).length >= 2 && Object.keys(pl[i]).length <= 3);
  }
  await expectError(OpenAI.BadRequestError,
    () => client.completions.create({ model, prompt, max_tokens: 1, prompt_logprobs: 21 }), 400);
  await expectError(OpenAI.BadRequestError,
    () => client.completions.create({ model, prompt, max_tokens: 1, prompt_logprobs: 1, stream: true }), 400);
});

await test('logit_bias, X-Request-Id, /version, usage.prompt_tokens_details', async () => {
  const prompt = 'def fib(n):';
  const first = await client.completions.create({ model, prompt, max_tokens: 1, temperature: 0, logprobs: 1 });
  const firstText = first.choices[0].text;
  const tokenized = await fetch(baseURL.replace(/\/v1$/, '/tokenize'), {
    method: 'POST', headers: { 'Content-Type': 'application/json' },
    body: JSON.stringify({ model, prompt: firstText, add_special_tokens: false }),
  }).then((r) => r.json());
  assert.equal(tokenized.tokens.length, 1, JSON.stringify(tokenized));
  const greedyId = tokenized.tokens[0];
  // -100 on the greedy token: another one comes first; +100 on a token: it does.
  const banned = await client.completions.create({ model, prompt, max_tokens: 1, temperature: 0, logit_bias: { [greedyId]: -100 } });
  assert.notEqual(banned.choices[0].text, firstText);
  const forced = await client.completions.create({ model, prompt, max_tokens: 3, temperature: 0.8, seed: 4, logit_bias: { [greedyId]: 100 } });
  assert.equal(forced.choices[0].text, firstText.repeat(3));
  // X-Request-Id: echoed, or made (and then the completion's id).
  const echoed = await client.completions.create({ model, prompt, max_tokens: 1 }, { headers: { 'X-Request-Id': 'sdk-req-1' } }).withResponse();
  assert.equal(echoed.response.headers.get('x-request-id'), 'sdk-req-1');
  assert.equal(echoed.data.id, 'cmpl-sdk-req-1');
  const made = await client.chat.completions.create({ model, messages: [{ role: 'user', content: 'hi' }], max_tokens: 1 }).withResponse();
  assert.match(made.response.headers.get('x-request-id'), /^[0-9a-f]{32}$/);
  assert.equal(made.data.id, `chatcmpl-${made.response.headers.get('x-request-id')}`);
  assert.equal(made.data.usage.prompt_tokens_details, null);
  const version = await fetch(baseURL.replace(/\/v1$/, '/version')).then((r) => r.json());
  assert.match(version.version, /^\d+\.\d+\.\d+/);
});

await test('chat: non-streaming and streaming, logprobs, n', async () => {
  const messages = [{ role: 'system', content: 'You write Python.' }, { role: 'user', content: 'Print hello.' }];
  const r = await client.chat.completions.create({ model, messages, max_tokens: 8, ...greedy });
  assert.equal(r.object, 'chat.completion');
  assert.match(r.id, /^chatcmpl-/);
  assert.equal(r.choices[0].message.role, 'assistant');
  assert.equal(typeof r.choices[0].message.content, 'string');
  assert.equal(r.usage.completion_tokens, 8);
  const stream = await client.chat.completions.create({
    model, messages, max_tokens: 8, ...greedy, stream: true, stream_options: { include_usage: true },
  });
  let content = '';
  let role = null;
  let usage = null;
  let finish = null;
  for await (const chunk of stream) {
    assert.equal(chunk.object, 'chat.completion.chunk');
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      if (c.delta.role) role = c.delta.role;
      if (c.delta.content) content += c.delta.content;
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  assert.equal(role, 'assistant');
  assert.equal(content, r.choices[0].message.content);
  assert.equal(finish, 'length');
  assert.deepEqual(usage, r.usage);
  const lp = await client.chat.completions.create({ model, messages, max_tokens: 3, ...greedy, logprobs: true, top_logprobs: 2 });
  const items = lp.choices[0].logprobs.content;
  assert.equal(items.length, 3);
  assert.equal(items[0].top_logprobs.length, 2);
  assert.ok(Array.isArray(items[0].bytes));
  const parts = await client.chat.completions.create({
    model, messages: [{ role: 'user', content: [{ type: 'text', text: 'Print hello.' }] }], max_tokens: 2, n: 2, ...greedy,
  });
  assert.equal(parts.choices.length, 2);
});

await test('errors: BadRequestError, NotFoundError', async () => {
  const e = await expectError(OpenAI.BadRequestError, () =>
    client.completions.create({ model, prompt: 'x', max_tokens: -3 }), 400);
  assert.equal(e.param, 'max_tokens');
  await expectError(OpenAI.BadRequestError, () => client.completions.create({ model, prompt: 'x', temperature: -1 }), 400);
  await expectError(OpenAI.BadRequestError, () => client.completions.create({ model, prompt: 'x', n: 0 }), 400);
  await expectError(OpenAI.BadRequestError, () => client.completions.create({ model, prompt: 42 }), 400);
  await expectError(OpenAI.BadRequestError, () => client.chat.completions.create({ model, messages: [] }), 400);
  const long = await expectError(OpenAI.BadRequestError, () =>
    client.completions.create({ model, prompt: 'hello '.repeat(5000), max_tokens: 16 }), 400);
  assert.equal(long.code, 'context_length_exceeded');
  await expectError(OpenAI.BadRequestError, () =>
    client.completions.create({ model, prompt: 'x', max_tokens: 100000000 }), 400);
  await expectError(OpenAI.BadRequestError, () =>
    client.completions.create({ model, prompt: 'x', stream: true, top_p: 7 }), 400);
  const nf = await expectError(OpenAI.NotFoundError, () =>
    client.completions.create({ model: 'no-such-model', prompt: 'x' }), 404);
  assert.equal(nf.code, 'model_not_found');
  await expectError(OpenAI.NotFoundError, () => client.chat.completions.create({ model: 'gpt-4', messages: [{ role: 'user', content: 'x' }] }), 404);
});

await test('errors: InternalServerError 503 when no worker is up', async () => {
  const down = new OpenAI({ baseURL: downBaseURL, apiKey: 'x', maxRetries: 0 });
  const e = await expectError(OpenAI.InternalServerError, () =>
    down.completions.create({ model, prompt: 'x', max_tokens: 2 }), 503);
  assert.equal(e.type, 'service_unavailable');
  assert.match(e.message, /no decode worker is up/);
  // Streaming too: the failure comes before the first chunk, so it is the HTTP status.
  await expectError(OpenAI.InternalServerError, () =>
    down.chat.completions.create({ model, messages: [{ role: 'user', content: 'x' }], max_tokens: 2, stream: true }), 503);
});

await test('errors: InternalServerError 500 when the decode worker sends an unparsable message', async () => {
  const fault = new OpenAI({ baseURL: faultBaseURL, apiKey: 'x', maxRetries: 0, timeout: 20000 });
  const e = await expectError(OpenAI.InternalServerError, () =>
    fault.completions.create({ model, prompt: 'x', max_tokens: 8 }), 500);
  assert.equal(e.type, 'server_error');
  // The worker by its label only: its address stays in the router log.
  assert.match(e.message, /decode worker 0 sent a stream message that is not a valid duet\.v1\.GenerateResponse/);
  assert.doesNotMatch(e.message, /127\.0\.0\.1/);
  await expectError(OpenAI.InternalServerError, () =>
    fault.chat.completions.create({ model, messages: [{ role: 'user', content: 'x' }], max_tokens: 8 }), 500);
});

await test('errors: a failure after the stream started is an SSE error event the SDK raises', async () => {
  const fault = new OpenAI({ baseURL: faultBaseURL, apiKey: 'x', maxRetries: 0, timeout: 20000 });
  const stream = await fault.completions.create({ model, prompt: 'x', max_tokens: 8, stream: true });
  let text = '';
  const e = await expectError(OpenAI.APIError, async () => {
    for await (const chunk of stream) text += chunk.choices.map((c) => c.text).join('');
  });
  assert.equal(text, 't0 t1 ', 'the chunks before the failure arrived');
  assert.equal(e.status, undefined, 'the HTTP status was 200: the error is in the stream');
  assert.equal(e.error.type, 'server_error');
  assert.match(e.error.message, /not a valid duet\.v1\.GenerateResponse/);
  const chat = await fault.chat.completions.create({
    model, messages: [{ role: 'user', content: 'x' }], max_tokens: 8, stream: true,
  });
  let content = '';
  const chatError = await expectError(OpenAI.APIError, async () => {
    for await (const chunk of chat) content += chunk.choices.map((c) => c.delta.content ?? '').join('');
  });
  assert.equal(content, 't0 t1 ');
  assert.match(chatError.message, /not a valid duet\.v1\.GenerateResponse/);
});

await test('errors: APIConnectionError', async () => {
  const dead = new OpenAI({ baseURL: 'http://127.0.0.1:1/v1', apiKey: 'x', maxRetries: 0 });
  await expectError(OpenAI.APIConnectionError, () => dead.completions.create({ model, prompt: 'x' }));
});

await test('errors: AuthenticationError, then RateLimitError over --max-concurrent-requests 1 without a queue', async () => {
  const wrong = new OpenAI({ baseURL: authBaseURL, apiKey: 'wrong-key', maxRetries: 0 });
  await expectError(OpenAI.AuthenticationError, () => wrong.completions.create({ model, prompt: 'x', max_tokens: 1 }), 401);
  await expectError(OpenAI.AuthenticationError, () => wrong.models.list(), 401);
  const right = new OpenAI({ baseURL: authBaseURL, apiKey: 'test-key', maxRetries: 0 });
  const ok = await right.completions.create({ model, prompt: 'x', max_tokens: 1 });
  assert.equal(ok.choices.length, 1);
  // Hold the only slot with a long stream, then ask again.
  const controller = new AbortController();
  const long = await right.completions.create(
    { model, prompt: 'def fib(n):', max_tokens: 1000, ...greedy, stream: true }, { signal: controller.signal });
  const it = long[Symbol.asyncIterator]();
  await it.next();  // the stream is running
  await expectError(OpenAI.RateLimitError, () => right.completions.create({ model, prompt: 'x', max_tokens: 1 }), 429);
  controller.abort();  // disconnect: the router aborts the request and frees its slot
  try { await it.next(); } catch { /* aborted */ }
  let freed = false;
  for (let i = 0; i < 100 && !freed; i++) {
    try {
      await right.completions.create({ model, prompt: 'x', max_tokens: 1 });
      freed = true;
    } catch (e) {
      if (!(e instanceof OpenAI.RateLimitError)) throw e;
      await new Promise((r) => setTimeout(r, 50));
    }
  }
  assert.ok(freed, 'the slot is freed after the client disconnected');
});

console.log(`openai_sdk_test: ${passed()} passed${process.exitCode ? ', some FAILED' : ''}`);
