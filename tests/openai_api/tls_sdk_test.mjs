// The official `openai` npm SDK over HTTPS (a router with --ssl-certfile/--ssl-keyfile; node
// trusts the test CA through NODE_EXTRA_CA_CERTS): the same answers as over plain HTTP.
// Env: OPENAI_TLS_BASE_URL (https://localhost:PORT/v1), OPENAI_BASE_URL (a plain router on the
// same workers), MODEL_NAME, NODE_DEPS_DIR.
import assert from 'node:assert/strict';
import { createRequire } from 'node:module';
import { test } from './test_runner.mjs';

const require = createRequire(`${process.env.NODE_DEPS_DIR}/package.json`);
const OpenAI = require('openai');

const model = process.env.MODEL_NAME;
assert.match(process.env.OPENAI_TLS_BASE_URL, /^https:/);
const tls = new OpenAI({ baseURL: process.env.OPENAI_TLS_BASE_URL, apiKey: 'unused', maxRetries: 0, timeout: 60000 });
const plain = new OpenAI({ baseURL: process.env.OPENAI_BASE_URL, apiKey: 'unused', maxRetries: 0, timeout: 60000 });
const greedy = { temperature: 0, ignore_eos: true };

await test('https: models.list', async () => {
  const models = await tls.models.list();
  assert.deepEqual(models.data.map((m) => m.id), [model]);
});

await test('https: completions equal plain HTTP (greedy)', async () => {
  const request = { model, prompt: 'def fib(n):', max_tokens: 10, ...greedy };
  const [secure, clear] = await Promise.all([tls.completions.create(request), plain.completions.create(request)]);
  assert.equal(secure.choices[0].text, clear.choices[0].text);
  assert.deepEqual(secure.usage, clear.usage);
});

await test('https: chat streams (SSE over TLS) the same text as without streaming', async () => {
  const messages = [{ role: 'user', content: 'Write a function that adds two numbers.' }];
  const whole = await tls.chat.completions.create({ model, messages, max_tokens: 12, ...greedy });
  let text = '';
  for await (const chunk of await tls.chat.completions.create({ model, messages, max_tokens: 12, ...greedy, stream: true })) {
    text += chunk.choices[0]?.delta?.content ?? '';
  }
  assert.equal(text, whole.choices[0].message.content);
});
