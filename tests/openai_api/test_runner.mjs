// The tiny runner the OpenAI client tests share: `await test(name, fn)` runs one case, prints
// ok/FAIL with its time, and a failure sets the process's exit code (the other cases still run).
let passedCount = 0;

export async function test(name, fn) {
  const start = Date.now();
  try {
    await fn();
    passedCount++;
    console.log(`ok   ${name} (${Date.now() - start} ms)`);
  } catch (e) {
    console.error(`FAIL ${name}:`, e);
    process.exitCode = 1;
  }
}

// Cases that passed so far.
export function passed() {
  return passedCount;
}
