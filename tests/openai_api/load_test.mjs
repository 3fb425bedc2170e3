// Load test: N concurrent SSE streams against the router's OpenAI API (not a timed test; a
// benchmark). Opens all N streams at once (short generations), counts the streams open at the
// same time, checks every stream ends with `data: [DONE]` and no errors, and samples the router's
// VmRSS and thread count from /proc/<pid>/status while they run.
// Env: BASE_URL (http://host:port), MODEL_NAME, ROUTER_PID, STREAMS (1000), MAX_TOKENS (4).
import http from 'node:http';
import fs from 'node:fs';

const base = new URL(process.env.BASE_URL);
const model = process.env.MODEL_NAME;
const pid = process.env.ROUTER_PID;
const streams = Number(process.env.STREAMS ?? 1000);
const maxTokens = Number(process.env.MAX_TOKENS ?? 4);
const agent = new http.Agent({ keepAlive: false, maxSockets: Infinity });

function procStatus() {
  try {
    const s = fs.readFileSync(`/proc/${pid}/status`, 'utf8');
    const kb = Number(/VmRSS:\s+(\d+)/.exec(s)[1]);
    const threads = Number(/Threads:\s+(\d+)/.exec(s)[1]);
    return { rssMiB: kb / 1024, threads };
  } catch {
    return { rssMiB: NaN, threads: NaN };
  }
}

const idle = procStatus();
let inflight = 0, peakInflight = 0, open = 0, peakOpen = 0, done = 0, errors = 0, tokens = 0;
let peak = { rssMiB: 0, threads: 0, openAtPeakRss: 0 };
const sampler = setInterval(() => {
  const s = procStatus();
  if (s.rssMiB > peak.rssMiB) peak = { ...peak, rssMiB: s.rssMiB, openAtPeakRss: inflight };
  if (s.threads > peak.threads) peak.threads = s.threads;
}, 50);

const ttft = [];
function one(i) {
  return new Promise((resolve) => {
    const body = JSON.stringify({
      model, prompt: `Request ${i}: def f(x):`, max_tokens: maxTokens, temperature: 0, ignore_eos: true, stream: true,
    });
    const start = performance.now();
    inflight++;
    peakInflight = Math.max(peakInflight, inflight);
    const req = http.request({
      host: base.hostname, port: base.port, path: '/v1/completions', method: 'POST', agent,
      headers: { 'content-type': 'application/json', 'content-length': Buffer.byteLength(body) },
    }, (res) => {
      let data = '';
      let first = true;
      open++;
      peakOpen = Math.max(peakOpen, open);
      res.setEncoding('utf8');
      res.on('data', (d) => {
        if (first) { ttft.push(performance.now() - start); first = false; }
        data += d;
      });
      res.on('end', () => {
        open--;
        const ok = res.statusCode === 200 && data.endsWith('data: [DONE]\n\n') && !data.includes('"error"');
        if (!ok) {
          errors++;
          if (errors <= 5) console.error(`stream ${i}: status ${res.statusCode}: ${data.slice(0, 300)}`);
        } else {
          tokens += data.split('\n\n').filter((e) => e.startsWith('data: {')).length;
        }
        done++;
        inflight--;
        resolve();
      });
    });
    req.on('error', (e) => {
      errors++;
      if (errors <= 5) console.error(`stream ${i}: ${e.message}`);
      done++;
      inflight--;
      resolve();
    });
    req.end(body);
  });
}

const t0 = performance.now();
await Promise.all(Array.from({ length: streams }, (_, i) => one(i)));
const seconds = (performance.now() - t0) / 1000;
clearInterval(sampler);
const after = procStatus();
ttft.sort((a, b) => a - b);
const pct = (p) => ttft.length ? ttft[Math.min(ttft.length - 1, Math.floor(p * ttft.length))].toFixed(0) : 'n/a';
const result = {
  streams, max_tokens: maxTokens, completed: done - errors, errors, peak_concurrent_requests: peakInflight, peak_concurrent_streaming_responses: peakOpen,
  seconds: Number(seconds.toFixed(2)), chunk_events: tokens,
  first_byte_ms: { p50: pct(0.5), p99: pct(0.99) },
  router: {
    idle_rss_mib: Number(idle.rssMiB.toFixed(1)), idle_threads: idle.threads,
    peak_rss_mib: Number(peak.rssMiB.toFixed(1)), peak_threads: peak.threads,
    requests_in_flight_at_peak_rss: peak.openAtPeakRss,
    after_rss_mib: Number(after.rssMiB.toFixed(1)), after_threads: after.threads,
  },
};
console.log(JSON.stringify(result, null, 2));
if (errors > 0 || peakInflight < streams) process.exitCode = 1;
