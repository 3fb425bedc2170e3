// Reference token ids from @lenml/tokenizers (transformers.js) for a JSONL corpus.
// Usage: node reference_ids.mjs <tokenizer-dir> <corpus.jsonl> <out.jsonl>
// <tokenizer-dir> holds tokenizer.json (and optionally tokenizer_config.json). Each output line is
// {"ids": [...]}: encode(text) without special tokens, as HF tokenizers'
// encode(text, add_special_tokens=False).
import fs from "node:fs";
import path from "node:path";
import { createRequire } from "node:module";

const require = createRequire(path.join(path.dirname(new URL(import.meta.url).pathname), "../node/"));
const { TokenizerLoader } = await import(require.resolve("@lenml/tokenizers"));

const [dir, corpusPath, outPath] = process.argv.slice(2);
if (!dir || !corpusPath || !outPath) {
  console.error("usage: node reference_ids.mjs <tokenizer-dir> <corpus.jsonl> <out.jsonl>");
  process.exit(2);
}
const readJson = (file) => JSON.parse(fs.readFileSync(file, "utf8"));
const configPath = path.join(dir, "tokenizer_config.json");
const tokenizer = TokenizerLoader.fromPreTrained({
  tokenizerJSON: readJson(path.join(dir, "tokenizer.json")),
  tokenizerConfig: fs.existsSync(configPath) ? readJson(configPath) : {},
});

const lines = fs.readFileSync(corpusPath, "utf8").split("\n").filter((line) => line.length > 0);
const out = lines.map((line) => {
  const { text } = JSON.parse(line);
  const ids = tokenizer.encode(text, { add_special_tokens: false });
  return JSON.stringify({ ids: Array.from(ids) });
});
fs.writeFileSync(outPath, out.join("\n") + "\n");
console.error(`wrote ${out.length} lines to ${outPath}`);
