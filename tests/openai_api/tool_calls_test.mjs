// Tool calling through the official `openai` npm SDK against a running local cluster, for both
// tool-call formats: a router with --tool-call-parser hermes and one with llama3_json (both with
// --enable-auto-tool-choice). The tiny model calls no tool by itself, so every call here is forced:
// tool_choice "required" and a named function by the grammar engine (the same on both routers),
// and tool_choice "auto" by a guided_grammar that makes the model write a call in the router's
// format, which the router's parser then turns into tool_calls. Non-streaming (create, and the
// SDK's parse(), which JSON-parses strict tools' arguments) and streaming (create with stream,
// and the SDK's ChatCompletionStream, which assembles the tool_call deltas); every call's
// arguments parse and match its schema; the calls then go back as history (assistant tool_calls
// and tool messages) through the chat template.
// Env: OPENAI_HERMES_BASE_URL, OPENAI_LLAMA_BASE_URL (…/v1), MODEL_NAME, NODE_DEPS_DIR.
import assert from 'node:assert/strict';
import { createRequire } from 'node:module';
import { passed, test } from './test_runner.mjs';

const require = createRequire(`${process.env.NODE_DEPS_DIR}/package.json`);
const OpenAI = require('openai');
const model = process.env.MODEL_NAME;
const routers = {
  hermes: new OpenAI({ baseURL: process.env.OPENAI_HERMES_BASE_URL, apiKey: 'unused', maxRetries: 0, timeout: 120000 }),
  llama3_json: new OpenAI({ baseURL: process.env.OPENAI_LLAMA_BASE_URL, apiKey: 'unused', maxRetries: 0, timeout: 120000 }),
};


const weatherParameters = {
  type: 'object',
  properties: {
    city: { type: 'string', maxLength: 10 },
    unit: { type: 'string', enum: ['celsius', 'fahrenheit'] },
  },
  required: ['city', 'unit'],
  additionalProperties: false,
};
const tools = [
  { type: 'function', function: { name: 'get_weather', description: 'Weather in a city.', parameters: weatherParameters, strict: true } },
  { type: 'function', function: { name: 'ping', description: 'Is the service up?', strict: true,
    parameters: { type: 'object', properties: {}, additionalProperties: false } } },
];
const messages = [{ role: 'user', content: 'What is the weather in Paris?' }];
const base = { model, messages, tools, temperature: 0, max_tokens: 96 };

function checkArguments(call) {
  assert.equal(call.type, 'function');
  assert.match(call.id, /^chatcmpl-tool-[0-9a-f]{32}$/);
  const args = JSON.parse(call.function.arguments);
  if (call.function.name === 'get_weather') {
    assert.deepEqual(Object.keys(args), ['city', 'unit'], call.function.arguments);
    assert.equal(typeof args.city, 'string');
    assert.ok([...args.city].length <= 10, args.city);
    assert.ok(['celsius', 'fahrenheit'].includes(args.unit), args.unit);
  } else {
    assert.equal(call.function.name, 'ping');
    assert.deepEqual(args, {});
  }
  return args;
}

function checkCompletion(r, { names }) {
  const choice = r.choices[0];
  assert.equal(choice.finish_reason, 'tool_calls', JSON.stringify(choice));
  assert.equal(choice.message.role, 'assistant');
  assert.ok(choice.message.content === null || choice.message.content === '', JSON.stringify(choice.message));
  const calls = choice.message.tool_calls;
  assert.ok(Array.isArray(calls) && calls.length >= 1, JSON.stringify(choice.message));
  if (names) assert.deepEqual(calls.map((c) => c.function.name), names);
  calls.forEach(checkArguments);
  return calls;
}

// A raw stream (create with stream: true): the deltas in the OpenAI shape, put together by hand.
async function streamedCalls(client, body) {
  const stream = await client.chat.completions.create({ ...body, stream: true });
  const calls = [];
  let finish = null;
  let content = '';
  for await (const chunk of stream) {
    const choice = chunk.choices[0];
    if (!choice) continue;
    content += choice.delta.content ?? '';
    for (const d of choice.delta.tool_calls ?? []) {
      if (d.id !== undefined) {
        assert.equal(d.index, calls.length, 'a new call takes the next index');
        assert.equal(d.type, 'function');
        calls.push({ id: d.id, type: d.type, function: { name: d.function.name, arguments: '' } });
      }
      assert.ok(calls[d.index], `delta for call ${d.index} before its first piece`);
      calls[d.index].function.arguments += d.function.arguments ?? '';
    }
    finish = choice.finish_reason ?? finish;
  }
  return { message: { role: 'assistant', content: content || null, tool_calls: calls }, finish_reason: finish };
}

// Each router's own format, forced on the model by a grammar: tool_choice "auto" parses it.
const forcedFormat = {
  hermes: 'root ::= "<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"" [a-zA-Z]{1,8} "\\", \\"unit\\": \\"celsius\\"}}\\n</tool_call>"',
  llama3_json: 'root ::= "{\\"name\\": \\"get_weather\\", \\"parameters\\": {\\"city\\": \\"" [a-zA-Z]{1,8} "\\", \\"unit\\": \\"celsius\\"}}"',
};

// The two routers' tests run side by side (they share the workers).
await Promise.all(Object.entries(routers).map(async ([format, client]) => {
  await test(`${format}: tool_choice required, non-streaming and streaming`, async () => {
    const body = { ...base, tool_choice: 'required', parallel_tool_calls: false };
    const whole = await client.chat.completions.create(body);
    const calls = checkCompletion(whole, {});
    assert.equal(calls.length, 1);
    const streamed = await streamedCalls(client, body);
    checkCompletion({ choices: [streamed] }, { names: calls.map((c) => c.function.name) });
    assert.deepEqual(streamed.message.tool_calls.map((c) => c.function.arguments), calls.map((c) => c.function.arguments));
  });

  await test(`${format}: a named function, create / parse / ChatCompletionStream`, async () => {
    const body = { ...base, tool_choice: { type: 'function', function: { name: 'get_weather' } } };
    const whole = await client.chat.completions.create(body);
    const [call] = checkCompletion(whole, { names: ['get_weather'] });
    // parse(): the SDK JSON-parses strict tools' arguments.
    const parsed = await client.beta.chat.completions.parse(body);
    assert.deepEqual(parsed.choices[0].message.tool_calls[0].function.parsed_arguments, JSON.parse(call.function.arguments));
    // The SDK's stream helper assembles the deltas into the same completion.
    const stream = client.beta.chat.completions.stream(body);
    let doneArguments = null;
    stream.on('tool_calls.function.arguments.done', (e) => { doneArguments = e.parsed_arguments; });
    const final = await stream.finalChatCompletion();
    checkCompletion(final, { names: ['get_weather'] });
    assert.equal(final.choices[0].message.tool_calls[0].function.arguments, call.function.arguments);
    assert.deepEqual(doneArguments, JSON.parse(call.function.arguments));
  });

  await test(`${format}: tool_choice auto parses the model's ${format} calls, streaming and not`, async () => {
    const body = { ...base, tool_choice: 'auto', guided_grammar: forcedFormat[format] };
    const whole = await client.chat.completions.create(body);
    const [call] = checkCompletion(whole, { names: ['get_weather'] });
    assert.equal(JSON.parse(call.function.arguments).unit, 'celsius');
    const streamed = await streamedCalls(client, body);
    checkCompletion({ choices: [streamed] }, { names: ['get_weather'] });
    assert.equal(streamed.message.tool_calls[0].function.arguments, call.function.arguments);
    const final = await client.beta.chat.completions.stream(body).finalChatCompletion();
    assert.equal(final.choices[0].message.tool_calls[0].function.arguments, call.function.arguments);
    // Without a call in the output, auto answers content.
    const plain = await client.chat.completions.create({ ...base, tool_choice: 'auto', max_tokens: 6 });
    assert.equal(plain.choices[0].message.tool_calls, undefined);
    assert.equal(typeof plain.choices[0].message.content, 'string');
    assert.equal(plain.choices[0].finish_reason, 'length');
  });

  await test(`${format}: the calls and their results go back as history`, async () => {
    const first = await client.chat.completions.create({ ...base, tool_choice: { type: 'function', function: { name: 'get_weather' } } });
    const assistant = first.choices[0].message;
    const history = [...messages, assistant,
      ...assistant.tool_calls.map((c) => ({ role: 'tool', tool_call_id: c.id, content: '{"temperature": 21}' }))];
    const next = await client.chat.completions.create({ ...base, messages: history, tool_choice: 'none', max_tokens: 4 });
    assert.equal(next.choices[0].finish_reason, 'length');
    assert.equal(next.choices[0].message.tool_calls, undefined);
    // The prompt it was given (/tokenize renders the same template): the call and its result.
    const root = client.baseURL.replace(/\/v1$/, '');
    const post = (path, body) => fetch(root + path, {
      method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify(body),
    }).then((r) => r.json());
    const tokenized = await post('/tokenize', { model, messages: history, tools });
    assert.equal(next.usage.prompt_tokens, tokenized.count);
    const { prompt } = await post('/detokenize', { model, tokens: tokenized.tokens });
    const args = JSON.parse(assistant.tool_calls[0].function.arguments);
    assert.ok(prompt.includes(`<tool_call>\n{"name": "get_weather", "arguments": {"city": ${JSON.stringify(args.city)}`), prompt);
    assert.ok(prompt.includes('<|im_start|>tool\n{"temperature": 21}<|im_end|>'), prompt);
    assert.ok(prompt.includes('"name": "ping"'), prompt);  // the tools, listed by the template
  });
}));

console.log(`tool_calls: ${passed()} tests passed`);
