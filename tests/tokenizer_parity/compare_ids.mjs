// Compares two JSONL files of {"ids": [...]} line by line against the corpus they came from.
// Usage: node compare_ids.mjs <corpus.jsonl> <expected.jsonl> <actual.jsonl>
// Prints each mismatch (line, text, first differing position, both id windows) and exits 1 on any.
import fs from "node:fs";

const [corpusPath, expectedPath, actualPath] = process.argv.slice(2);
if (!corpusPath || !expectedPath || !actualPath) {
  console.error("usage: node compare_ids.mjs <corpus.jsonl> <expected.jsonl> <actual.jsonl>");
  process.exit(2);
}
const readLines = (file) =>
  fs.readFileSync(file, "utf8").split("\n").filter((line) => line.length > 0).map((line) => JSON.parse(line));
const corpus = readLines(corpusPath);
const expected = readLines(expectedPath);
const actual = readLines(actualPath);

let failures = 0;
if (expected.length !== corpus.length || actual.length !== corpus.length) {
  console.error(`line counts differ: corpus ${corpus.length}, expected ${expected.length}, actual ${actual.length}`);
  failures++;
}
const shorten = (text) => {
  const json = JSON.stringify(text);
  return json.length > 120 ? json.slice(0, 117) + "..." : json;
};
for (let i = 0; i < Math.min(corpus.length, expected.length, actual.length); i++) {
  const want = expected[i].ids;
  const got = actual[i].ids;
  if (!Array.isArray(got)) {
    console.error(`line ${i + 1}: no "ids" array in output: ${JSON.stringify(actual[i]).slice(0, 200)}`);
    failures++;
    continue;
  }
  let diff = 0;
  while (diff < want.length && diff < got.length && want[diff] === got[diff]) diff++;
  if (diff === want.length && diff === got.length) continue;
  failures++;
  const from = Math.max(0, diff - 3);
  console.error(`line ${i + 1}: ${shorten(corpus[i].text)}`);
  console.error(`  first difference at id #${diff} (expected ${want.length} ids, got ${got.length})`);
  console.error(`  expected [${from}..]: ${JSON.stringify(want.slice(from, diff + 8))}`);
  console.error(`  actual   [${from}..]: ${JSON.stringify(got.slice(from, diff + 8))}`);
}
if (failures > 0) {
  console.error(`${failures} mismatching line(s) of ${corpus.length}`);
  process.exit(1);
}
console.log(`all ${corpus.length} lines match`);
