// Renders every (template, conversation) pair with @huggingface/jinja, the reference.
//
//   node render_reference.mjs [output-dir]    (default: ./expected)
//
// Writes <output-dir>/<template>.jsonl: one line per conversation, {"case", "output"} or
// {"case", "error"} when the template refuses it (e.g. raise_exception). Needs `npm install`
// in tests/node. Every context gets a fixed date_string so strftime_now never shows.
import fs from "node:fs";
import path from "node:path";
import { createRequire } from "node:module";
import { fileURLToPath } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const require = createRequire(path.join(here, "../node/package.json"));
const { Template } = await import(require.resolve("@huggingface/jinja"));

const outDir = path.resolve(process.argv[2] ?? path.join(here, "expected"));
fs.mkdirSync(outDir, { recursive: true });

const templates = JSON.parse(fs.readFileSync(path.join(here, "templates/index.json"), "utf8"));
const conversations = JSON.parse(fs.readFileSync(path.join(here, "conversations.json"), "utf8"));

export function contextFor(entry, conversation) {
  const context = {
    messages: conversation.messages,
    add_generation_prompt: conversation.add_generation_prompt,
    bos_token: entry.bos_token,
    eos_token: entry.eos_token,
    date_string: "26 Jul 2024",
  };
  if (conversation.tools) context.tools = conversation.tools;
  if ("enable_thinking" in conversation) context.enable_thinking = conversation.enable_thinking;
  return context;
}

for (const entry of templates) {
  const source = fs.readFileSync(path.join(here, "templates", entry.file), "utf8");
  const template = new Template(source);
  const lines = conversations.map((conversation) => {
    // structuredClone: the reference must not see values mutated by an earlier render.
    const context = structuredClone(contextFor(entry, conversation));
    try {
      return JSON.stringify({ case: conversation.name, output: template.render(context) });
    } catch (error) {
      return JSON.stringify({ case: conversation.name, error: String(error.message ?? error) });
    }
  });
  fs.writeFileSync(path.join(outDir, `${entry.name}.jsonl`), lines.join("\n") + "\n");
  console.log(`${entry.name}: ${lines.length} conversations`);
}
