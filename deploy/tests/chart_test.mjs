// The Helm chart (deploy/helm/duet), rendered by helm_render (Helm's template semantics without
// the helm binary: helm_render/main.go) for its default values and the realistic value sets in
// values/, and every rendered object checked:
//  - against the Kubernetes API's own types: field names (the generated models of
//    @kubernetes/client-node, so a misspelled or misplaced field fails) and kubernetes-models'
//    validators (types, required fields, enums); the CRDs against @kubernetes-models/
//    prometheus-operator and keda;
//  - against each other: selectors match pod labels, Service ports name container ports, mounts
//    have volumes, referenced ConfigMaps and Secrets exist, the router's discovery targets are
//    the workers' headless Services, every flag that names a file under /etc/duet names one a
//    read-only Secret volume provides;
//  - against what each value set asks for (replicas, GPUs, flags).
// Bad values must be refused with the reason (values.schema.json, the chart's own checks).
//
// Env: NODE_DEPS_DIR (tests/node), HELM_RENDER (the helm_render binary). Run: node --test.
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import test from 'node:test';
import { pathToFileURL, fileURLToPath } from 'node:url';

const here = path.dirname(fileURLToPath(import.meta.url));
const chartDir = path.join(here, '..', 'helm', 'duet');
const valuesDir = path.join(here, 'values');
const depsDir = process.env.NODE_DEPS_DIR;
const helmRender = process.env.HELM_RENDER;
assert.ok(depsDir && helmRender, 'set NODE_DEPS_DIR and HELM_RENDER');

const load = (rel) => import(pathToFileURL(path.join(depsDir, 'node_modules', rel)).href);
const YAML = await load('yaml/dist/index.js');
const k8sModels = await load('@kubernetes/client-node/dist/gen/models/all.js');

const NAMESPACE = 'inference';
const RELEASE = 'duet';

function render(valueFiles, extraArgs = []) {
  const args = ['--name', RELEASE, '--namespace', NAMESPACE, ...extraArgs];
  for (const f of valueFiles) args.push('-f', f);
  args.push(chartDir);
  return spawnSync(helmRender, args, { encoding: 'utf8' });
}

function renderObjects(valueFiles) {
  const result = render(valueFiles);
  assert.equal(result.status, 0, `helm_render failed:\n${result.stderr}`);
  const objects = [];
  // YAML 1.1, as helm and kubectl read manifests (sigs.k8s.io/yaml): 0444 is octal.
  for (const doc of YAML.parseAllDocuments(result.stdout, { version: '1.1' })) {
    assert.equal(doc.errors.length, 0, String(doc.errors));
    const obj = doc.toJS();
    if (obj !== null) objects.push(obj);
  }
  return objects;
}

// ---- schema checks ---------------------------------------------------------------------------

// apiVersion/kind -> [client-node model (field names), kubernetes-models module (validate)].
const CORE_KINDS = {
  'v1/ConfigMap': ['V1ConfigMap', 'kubernetes-models/v1/ConfigMap.js'],
  'v1/Secret': ['V1Secret', 'kubernetes-models/v1/Secret.js'],
  'v1/Service': ['V1Service', 'kubernetes-models/v1/Service.js'],
  'v1/ServiceAccount': ['V1ServiceAccount', 'kubernetes-models/v1/ServiceAccount.js'],
  'apps/v1/Deployment': ['V1Deployment', 'kubernetes-models/apps/v1/Deployment.js'],
  'apps/v1/StatefulSet': ['V1StatefulSet', 'kubernetes-models/apps/v1/StatefulSet.js'],
  'policy/v1/PodDisruptionBudget': ['V1PodDisruptionBudget', 'kubernetes-models/policy/v1/PodDisruptionBudget.js'],
  'networking.k8s.io/v1/NetworkPolicy': ['V1NetworkPolicy', 'kubernetes-models/networking.k8s.io/v1/NetworkPolicy.js'],
  'networking.k8s.io/v1/Ingress': ['V1Ingress', 'kubernetes-models/networking.k8s.io/v1/Ingress.js'],
  'autoscaling/v2/HorizontalPodAutoscaler': ['V2HorizontalPodAutoscaler',
    'kubernetes-models/autoscaling/v2/HorizontalPodAutoscaler.js'],
};
const CRD_KINDS = {
  'monitoring.coreos.com/v1/ServiceMonitor': '@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor.js',
  'monitoring.coreos.com/v1/PodMonitor': '@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PodMonitor.js',
  'monitoring.coreos.com/v1/PrometheusRule': '@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PrometheusRule.js',
  'keda.sh/v1alpha1/ScaledObject': '@kubernetes-models/keda/keda.sh/v1alpha1/ScaledObject.js',
};

// Every field of `value` must exist in the API type `type` (recursively), with a JSON type that fits.
function checkFields(value, type, where, errors, parentType = '') {
  if (value === null || value === undefined) return;
  if (type.startsWith('Array<')) {
    if (!Array.isArray(value)) return void errors.push(`${where}: expected a list`);
    value.forEach((v, i) => checkFields(v, type.slice(6, -1), `${where}[${i}]`, errors));
    return;
  }
  const map = /^\{ \[key: string\]: (.+); \}$/.exec(type);
  if (map) {
    if (typeof value !== 'object' || Array.isArray(value)) return void errors.push(`${where}: expected a map`);
    // Resource quantities are strings in the models but the API takes numbers too (nvidia.com/gpu: 1).
    const valueType = parentType === 'V1ResourceRequirements' && map[1] === 'string' ? 'IntOrString' : map[1];
    for (const [k, v] of Object.entries(value)) checkFields(v, valueType, `${where}.${k}`, errors);
    return;
  }
  const scalar = { string: 'string', number: 'number', boolean: 'boolean' }[type];
  if (scalar) {
    if (typeof value !== scalar) errors.push(`${where}: expected a ${scalar}, got ${JSON.stringify(value)}`);
    return;
  }
  if (type === 'IntOrString') {
    if (typeof value !== 'string' && typeof value !== 'number') errors.push(`${where}: expected an int or a string`);
    return;
  }
  if (type === 'Date' || type === 'V1MicroTime' || type === 'any') return;
  const model = k8sModels[type];
  if (!model?.getAttributeTypeMap) return void errors.push(`${where}: unknown API type ${type}`);
  if (typeof value !== 'object' || Array.isArray(value)) return void errors.push(`${where}: expected an object (${type})`);
  const fields = new Map(model.getAttributeTypeMap().map((a) => [a.baseName, a.type]));
  for (const [k, v] of Object.entries(value)) {
    if (!fields.has(k)) errors.push(`${where}.${k}: ${type} has no field "${k}"`);
    else checkFields(v, fields.get(k), `${where}.${k}`, errors, type);
  }
}

async function validateObject(obj) {
  const key = `${obj.apiVersion}/${obj.kind}`;
  const name = `${obj.kind} ${obj.metadata?.name}`;
  let modulePath;
  if (CORE_KINDS[key]) {
    const errors = [];
    checkFields(obj, CORE_KINDS[key][0], name, errors);
    assert.deepEqual(errors, [], `${name} does not fit the Kubernetes API`);
    modulePath = CORE_KINDS[key][1];
  } else if (CRD_KINDS[key]) {
    modulePath = CRD_KINDS[key];
  } else {
    assert.fail(`${name}: ${key} is not a kind this test can check`);
  }
  const Model = Object.values(await load(modulePath)).find((v) => typeof v === 'function');
  try {
    new Model(obj).validate();
  } catch (e) {
    assert.fail(`${name}: ${e.message}`);
  }
}

// ---- consistency checks ----------------------------------------------------------------------

const workloads = (objects) => objects.filter((o) => ['Deployment', 'StatefulSet'].includes(o.kind));
const find = (objects, kind, name) => objects.find((o) => o.kind === kind && o.metadata.name === name);
const matches = (selector, labels) => Object.entries(selector).every(([k, v]) => labels?.[k] === v);
const component = (objects, role) => workloads(objects).find((o) => o.spec.template.metadata.labels['app.kubernetes.io/component'] === role);
const args = (w) => w.spec.template.spec.containers[0].args;
const flag = (w, name) => args(w).find((a) => a.startsWith(`--${name}=`))?.slice(name.length + 3);

// The Secret key behind `file` in workload w's container, through its volume mounts and the
// volume's items: {secret, key, readOnly}, or undefined when no Secret volume provides the file.
function secretFile(w, file) {
  const pod = w.spec.template.spec;
  const dir = (m) => m.mountPath.replace(/\/$/, '');
  const mount = (pod.containers[0].volumeMounts ?? []).find((m) => file.startsWith(`${dir(m)}/`));
  const volume = mount && (pod.volumes ?? []).find((v) => v.name === mount.name);
  if (!volume?.secret) return undefined;
  const relative = file.slice(dir(mount).length + 1);
  const items = volume.secret.items;
  const key = items ? items.find((i) => i.path === relative)?.key : relative;
  if (key === undefined) return undefined;
  return { secret: volume.secret.secretName, key, readOnly: mount.readOnly === true };
}
const tlsFlags = (w) => args(w).filter((a) => /^--(ssl-|internal-tls-)/.test(a));

function checkConsistency(objects) {
  const names = new Set();
  for (const o of objects) {
    const id = `${o.kind}/${o.metadata.name}`;
    assert.ok(!names.has(id), `${id} rendered twice`);
    names.add(id);
    assert.match(o.metadata.name, /^[a-z0-9]([-a-z0-9]*[a-z0-9])?$/, `${id}: not a DNS-1123 name`);
    assert.ok(o.metadata.name.length <= 63, `${id}: name longer than 63`);
  }
  for (const w of workloads(objects)) {
    const pod = w.spec.template;
    assert.ok(matches(w.spec.selector.matchLabels, pod.metadata.labels), `${w.metadata.name}: selector misses its pods`);
    const volumes = new Set((pod.spec.volumes ?? []).map((v) => v.name));
    for (const c of [...(pod.spec.initContainers ?? []), ...pod.spec.containers]) {
      for (const m of c.volumeMounts ?? []) assert.ok(volumes.has(m.name), `${w.metadata.name}/${c.name}: no volume ${m.name}`);
      for (const e of c.envFrom ?? []) {
        if (e.configMapRef) assert.ok(find(objects, 'ConfigMap', e.configMapRef.name), `no ConfigMap ${e.configMapRef.name}`);
      }
      for (const e of c.env ?? []) {
        const ref = e.valueFrom?.secretKeyRef;
        if (ref) {
          const secret = find(objects, 'Secret', ref.name);
          assert.ok(secret, `${w.metadata.name}: no Secret ${ref.name}`);
          assert.ok(ref.key in secret.data, `Secret ${ref.name} has no key ${ref.key}`);
        }
      }
      const ports = new Set((c.ports ?? []).map((p) => p.name));
      for (const probe of [c.readinessProbe, c.livenessProbe, c.startupProbe].filter(Boolean)) {
        const port = probe.httpGet?.port ?? probe.tcpSocket?.port ?? probe.grpc?.port;
        if (typeof port === 'string') assert.ok(ports.has(port), `${c.name}: probe on unknown port ${port}`);
        else assert.ok(c.ports.some((p) => p.containerPort === port), `${c.name}: probe on unknown port ${port}`);
      }
    }
    // Secret files belong to root (group fsGroup, when the pod sets one); the image runs as
    // uid 10001 (deploy/docker/Dockerfile), so without fsGroup they must be readable by others.
    if (pod.spec.securityContext?.fsGroup === undefined) {
      for (const v of (pod.spec.volumes ?? []).filter((v) => v.secret)) {
        const mode = v.secret.defaultMode ?? 0o644;
        assert.ok(mode & 0o004, `${w.metadata.name}: volume ${v.name} mode 0${mode.toString(8)} is unreadable for uid 10001`);
      }
    }
    // Files the chart mounts (token, certificates) come from Secrets, read-only.
    for (const a of args(w)) {
      const file = /^--[a-z-]+=(\/etc\/duet\/.*)$/.exec(a)?.[1];
      if (!file) continue;
      const source = secretFile(w, file);
      assert.ok(source, `${w.metadata.name}: ${a}: no Secret volume mounts that file`);
      assert.ok(source.readOnly, `${w.metadata.name}: ${a}: mounted writable`);
    }
    if (w.kind === 'StatefulSet') {
      const svc = find(objects, 'Service', w.spec.serviceName);
      assert.equal(svc?.spec.clusterIP, 'None', `${w.metadata.name}: serviceName must be a headless Service`);
    }
  }
  for (const svc of objects.filter((o) => o.kind === 'Service')) {
    const backing = workloads(objects).filter((w) => matches(svc.spec.selector, w.spec.template.metadata.labels));
    assert.equal(backing.length, 1, `Service ${svc.metadata.name} selects ${backing.length} workloads`);
    const containerPorts = backing[0].spec.template.spec.containers[0].ports.map((p) => p.name);
    for (const p of svc.spec.ports) assert.ok(containerPorts.includes(p.targetPort), `${svc.metadata.name}: no container port ${p.targetPort}`);
  }
  for (const pdb of objects.filter((o) => o.kind === 'PodDisruptionBudget')) {
    assert.ok(workloads(objects).some((w) => matches(pdb.spec.selector.matchLabels, w.spec.template.metadata.labels)), `PDB ${pdb.metadata.name} selects nothing`);
  }
  for (const scaler of objects.filter((o) => o.kind === 'ScaledObject' || o.kind === 'HorizontalPodAutoscaler')) {
    const target = find(objects, scaler.spec.scaleTargetRef.kind, scaler.spec.scaleTargetRef.name);
    assert.ok(target, `${scaler.kind} ${scaler.metadata.name} targets nothing`);
    assert.equal(target.spec.replicas, undefined, `${target.metadata.name}: replicas set while an autoscaler owns them`);
  }
  // The router discovers the workers through their headless Services, on their gRPC ports.
  const router = component(objects, 'router');
  for (const role of ['prefill', 'decode']) {
    const target = flag(router, `${role}-service`);
    const m = /^dns:\/\/\/([^.]+)\.([^.]+)\.svc\.cluster\.local:(\d+)$/.exec(target);
    assert.ok(m, `--${role}-service=${target}`);
    assert.equal(m[2], NAMESPACE);
    const svc = find(objects, 'Service', m[1]);
    assert.equal(svc?.spec.clusterIP, 'None', `${target}: not a headless Service`);
    assert.equal(svc.spec.publishNotReadyAddresses, false, 'a draining (not ready) worker must leave DNS');
    assert.ok(svc.spec.ports.some((p) => p.name === 'grpc' && p.port === Number(m[3])), `${target}: wrong port`);
    const worker = component(objects, role);
    assert.ok(matches(svc.spec.selector, worker.spec.template.metadata.labels));
    assert.equal(args(worker)[0], `${role}-worker`);
    assert.equal(flag(worker, 'port'), m[3]);
    assert.equal(flag(worker, 'model'), flag(router, 'model'), 'router and workers load the same model directory');
    const c = worker.spec.template.spec.containers[0];
    if (flag(worker, 'internal-tls-ca-certs')) {
      // Mutual TLS: the kubelet's gRPC probe cannot present a client certificate.
      for (const probe of [c.startupProbe, c.readinessProbe]) {
        assert.deepEqual([probe.grpc, probe.tcpSocket], [undefined, { port: 'grpc' }], `${role}: a TCP probe under mutual TLS`);
      }
    } else {
      assert.equal(c.readinessProbe.grpc.port, Number(m[3]), 'workers use the native gRPC probe');
    }
    assert.ok(worker.spec.template.spec.terminationGracePeriodSeconds > Number(flag(worker, 'shutdown-grace-seconds')));
  }
  const routerProbe = router.spec.template.spec.containers[0].readinessProbe;
  if (flag(router, 'ssl-cert-reqs') === '2') {
    assert.deepEqual(routerProbe.tcpSocket, { port: 'http' }, 'no client certificate for the kubelet: a TCP probe');
  } else {
    assert.equal(routerProbe.httpGet.path, '/health');
    assert.equal(routerProbe.httpGet.scheme, flag(router, 'ssl-certfile') ? 'HTTPS' : undefined, 'the probe speaks the port\'s protocol');
  }
}

const gpus = (w) => w.spec.template.spec.containers[0].resources?.limits?.['nvidia.com/gpu'];

async function checkAll(objects) {
  for (const o of objects) await validateObject(o);
  checkConsistency(objects);
}

// ---- the value sets ------------------------------------------------------------------------

test('default values', async () => {
  const objects = renderObjects([]);
  await checkAll(objects);
  assert.equal(component(objects, 'router').spec.replicas, 2);
  assert.equal(gpus(component(objects, 'decode')), 1);
  assert.equal(flag(component(objects, 'decode'), 'backend'), 'cuda');
  assert.equal(flag(component(objects, 'router'), 'model'), '/opt/duet/models/tiny-code-llama');
  assert.ok(find(objects, 'Secret', 'duet-internal-token'), 'an internal token by default');
  assert.equal(objects.filter((o) => o.kind === 'NetworkPolicy').length, 3);
  for (const w of workloads(objects)) assert.deepEqual(tlsFlags(w), [], `${w.metadata.name}: plaintext by default`);
});

test('CPU only', async () => {
  const objects = renderObjects([path.join(valuesDir, 'cpu-only.yaml')]);
  await checkAll(objects);
  for (const w of workloads(objects)) {
    assert.equal(gpus(w), undefined, `${w.metadata.name} asks for a GPU`);
    assert.match(w.spec.template.spec.containers[0].image, /-cpu$/);
  }
  assert.equal(flag(component(objects, 'decode'), 'backend'), 'cpu');
  assert.equal(flag(component(objects, 'decode'), 'kv-cache-gib'), '4');
  assert.equal(component(objects, 'decode').spec.replicas, 2);
  assert.equal(component(objects, 'router').spec.template.spec.volumes.find((v) => v.name === 'model').hostPath.path, '/srv/models');
});

test('2 prefill + 4 decode GPUs', async () => {
  const objects = renderObjects([path.join(valuesDir, 'gpu-2p4d.yaml')]);
  await checkAll(objects);
  const prefill = component(objects, 'prefill');
  const decode = component(objects, 'decode');
  assert.equal(prefill.spec.replicas, 2);
  assert.equal(gpus(prefill), 1);
  assert.equal(decode.kind, 'StatefulSet');
  assert.equal(gpus(decode), 1);
  const keda = find(objects, 'ScaledObject', 'duet-decode');
  assert.equal(keda.spec.minReplicaCount, 4);
  assert.match(keda.spec.triggers[0].metadata.query, /duet:num_requests_waiting\{role="decode",namespace="inference"/);
  assert.equal(flag(decode, 'speculation'), 'lookahead');
  assert.equal(flag(decode, 'max-num-mixed-tokens'), '512');
  assert.equal(flag(prefill, 'max-num-mixed-tokens'), undefined);
  assert.equal(flag(component(objects, 'router'), 'served-model-name'), 'llama-3.1-8b');
  assert.equal(flag(component(objects, 'router'), 'local-prefill-max-tokens'), '1024');
  assert.equal(flag(component(objects, 'router'), 'local-prefill-queue-tokens'), '4096');
  assert.equal(flag(prefill, 'served-model-name'), 'llama-3.1-8b');  // the workers' metrics say it too
  assert.equal(flag(decode, 'served-model-name'), 'llama-3.1-8b');
  assert.equal(find(objects, 'ConfigMap', 'duet-env').data.UCX_TLS, 'tcp,cuda_copy,cuda_ipc');
  const rule = find(objects, 'PrometheusRule', 'duet');
  const alerts = rule.spec.groups.flatMap((g) => g.rules.map((r) => r.alert));
  const plain = YAML.parse(fs.readFileSync(path.join(here, '..', 'prometheus', 'duet-rules.yml'), 'utf8'));
  assert.deepEqual(rule.spec.groups, plain.groups, 'the PrometheusRule carries the rules file as it is');
  assert.ok(alerts.includes('DuetKvTransferFailures'));
  const dashboard = JSON.parse(find(objects, 'ConfigMap', 'duet-grafana-dashboard').data['duet.json']);
  assert.equal(dashboard.uid, 'duet-overview');
  assert.equal(find(objects, 'ServiceMonitor', 'duet').metadata.labels.release, 'kube-prometheus-stack');
});

test('sequence-parallel prefill', async () => {
  const objects = renderObjects([path.join(valuesDir, 'sequence-parallel.yaml')]);
  await checkAll(objects);
  const prefill = component(objects, 'prefill');
  assert.equal(flag(prefill, 'sp-ranks'), '4');
  assert.equal(flag(prefill, 'sp-min-tokens'), '2048');
  assert.equal(flag(component(objects, 'decode'), 'sp-ranks'), undefined);
  assert.equal(prefill.spec.template.spec.initContainers[0].name, 'fetch-model');
  const hpa = find(objects, 'HorizontalPodAutoscaler', 'duet-prefill');
  assert.equal(hpa.spec.metrics[0].pods.metric.name, 'duet_num_requests_waiting');
  assert.ok(find(objects, 'PodMonitor', 'duet'));
});

test('sequence-parallel prefill on a GPU (virtual ranks of one GPU)', async () => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'duet-chart-'));
  const file = path.join(dir, 'values.yaml');
  fs.writeFileSync(file, 'prefill: {parallelism: {sequence: 4}}\n');
  const objects = renderObjects([file]);
  fs.rmSync(dir, { recursive: true });
  await checkAll(objects);
  const prefill = component(objects, 'prefill');
  assert.equal(flag(prefill, 'backend'), 'cuda');
  assert.equal(flag(prefill, 'sp-ranks'), '4');
  assert.equal(gpus(prefill), 1);
});

test('API key and TLS', async () => {
  const objects = renderObjects([path.join(valuesDir, 'apikey-tls.yaml')]);
  // The internal token Secret is the operator's (existingSecret): stand in for it.
  objects.push({ apiVersion: 'v1', kind: 'Secret', metadata: { name: 'duet-internal-token' }, data: { token: 'eA==' } });
  await checkAll(objects);
  const router = component(objects, 'router');
  assert.equal(flag(router, 'api-key'), '$(DUET_API_KEY)');
  const env = router.spec.template.spec.containers[0].env.find((e) => e.name === 'DUET_API_KEY');
  const secret = find(objects, 'Secret', env.valueFrom.secretKeyRef.name);
  assert.equal(Buffer.from(secret.data['api-key'], 'base64').toString(), 'sk-duet-test');
  const ingress = find(objects, 'Ingress', 'duet-router');
  assert.deepEqual(ingress.spec.tls, [{ secretName: 'duet-tls', hosts: ['duet.example.com'] }]);
  const decode = component(objects, 'decode');
  const tokenVolume = decode.spec.template.spec.volumes.find((v) => v.name === 'internal-token');
  assert.equal(tokenVolume.secret.secretName, 'duet-internal-token');
  assert.equal(flag(decode, 'internal-token-file'), '/etc/duet/internal-token/token');
  // Only the router reaches a worker's gRPC port.
  const policy = find(objects, 'NetworkPolicy', 'duet-decode');
  const grpcRule = policy.spec.ingress.find((r) => r.ports?.some((p) => p.port === 'grpc'));
  assert.deepEqual(grpcRule.from, [{ podSelector: { matchLabels: {
    'app.kubernetes.io/name': 'duet', 'app.kubernetes.io/instance': 'duet', 'app.kubernetes.io/component': 'router' } } }]);
  const routerPolicy = find(objects, 'NetworkPolicy', 'duet-router');
  assert.equal(routerPolicy.spec.ingress[0].from[0].namespaceSelector.matchLabels['kubernetes.io/metadata.name'], 'ingress-nginx');
});

test('TLS: the router serves TLS, router and workers talk mutual TLS', async () => {
  const objects = renderObjects([path.join(valuesDir, 'tls.yaml')]);
  await checkAll(objects);
  const router = component(objects, 'router');
  const routerTls = { secret: 'duet-router-tls', readOnly: true };
  const internalTls = { secret: 'duet-internal-tls', readOnly: true };
  assert.deepEqual(secretFile(router, flag(router, 'ssl-certfile')), { ...routerTls, key: 'tls.crt' });
  assert.deepEqual(secretFile(router, flag(router, 'ssl-keyfile')), { ...routerTls, key: 'tls.key' });
  assert.equal(flag(router, 'ssl-ca-certs'), undefined, 'no client certificates asked for');
  assert.equal(flag(router, 'ssl-cert-reqs'), undefined);
  for (const w of [router, component(objects, 'prefill'), component(objects, 'decode')]) {
    const name = w.metadata.name;
    assert.deepEqual(secretFile(w, flag(w, 'internal-tls-certfile')), { ...internalTls, key: 'tls.crt' }, name);
    assert.deepEqual(secretFile(w, flag(w, 'internal-tls-keyfile')), { ...internalTls, key: 'tls.key' }, name);
    assert.deepEqual(secretFile(w, flag(w, 'internal-tls-ca-certs')), { ...internalTls, key: 'ca.crt' }, name);
  }
  // Discovery yields pod IPs: the router checks one name, the one the workers' certificate carries.
  assert.equal(flag(router, 'internal-tls-server-name'), 'duet-workers.inference.svc');
  for (const role of ['prefill', 'decode']) {
    const w = component(objects, role);
    assert.deepEqual(tlsFlags(w).map((a) => a.split('=')[0]).sort(),
      ['--internal-tls-ca-certs', '--internal-tls-certfile', '--internal-tls-keyfile'], `${role}: the worker's flags only`);
    assert.ok(!w.spec.template.spec.volumes.some((v) => v.secret?.secretName === 'duet-router-tls'), `${role}: the router's key stays on the router`);
    const c = w.spec.template.spec.containers[0];
    assert.deepEqual(c.startupProbe, { tcpSocket: { port: 'grpc' }, periodSeconds: 10, failureThreshold: 60 });
    assert.deepEqual(c.readinessProbe, { tcpSocket: { port: 'grpc' }, periodSeconds: 5, failureThreshold: 2 });
    assert.deepEqual(c.livenessProbe.tcpSocket, { port: 'grpc' });
  }
  const c = router.spec.template.spec.containers[0];
  assert.deepEqual(c.readinessProbe.httpGet, { path: '/health', port: 'http', scheme: 'HTTPS' });
  assert.deepEqual(c.livenessProbe.tcpSocket, { port: 'grpc' });
  const service = find(objects, 'Service', 'duet-router');
  assert.equal(service.spec.ports.find((p) => p.name === 'http').appProtocol, 'https');
  // Duet's metrics exporters serve plain HTTP on every role's metrics port, TLS or not.
  for (const w of workloads(objects)) {
    const metricsPort = w.spec.template.spec.containers[0].ports.find((p) => p.name === 'metrics');
    assert.equal(flag(w, 'metrics-port'), String(metricsPort.containerPort), `${w.metadata.name}: metrics port`);
  }
  const endpoints = [...find(objects, 'ServiceMonitor', 'duet').spec.endpoints,
    ...find(objects, 'PodMonitor', 'duet').spec.podMetricsEndpoints];
  assert.equal(endpoints.length, 2);
  for (const e of endpoints) {
    assert.equal(e.port, 'metrics');
    assert.ok([undefined, 'http'].includes(e.scheme), `scheme ${e.scheme}: the metrics ports speak plain HTTP`);
    assert.equal(e.tlsConfig, undefined);
  }
});

test('TLS: client certificates required by the router', async () => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'duet-chart-'));
  const sameSecret = path.join(dir, 'same.yaml');
  const ownCa = path.join(dir, 'own-ca.yaml');
  fs.writeFileSync(sameSecret, `tls: {router: {enabled: true, existingSecret: duet-router-tls, clientCertRequired: true}}
router: {probes: {liveness: {tcpSocket: null, grpc: {port: 50051}}}}
`);
  fs.writeFileSync(ownCa, 'tls: {router: {enabled: true, existingSecret: duet-router-tls, clientCertRequired: true, clientCaSecret: duet-client-ca}}\n');
  const withSameSecret = renderObjects([sameSecret]);
  const withOwnCa = renderObjects([ownCa]);
  fs.rmSync(dir, { recursive: true });
  await checkAll(withSameSecret);
  await checkAll(withOwnCa);
  let router = component(withSameSecret, 'router');
  assert.equal(flag(router, 'ssl-cert-reqs'), '2');
  assert.deepEqual(secretFile(router, flag(router, 'ssl-ca-certs')), { secret: 'duet-router-tls', key: 'ca.crt', readOnly: true });
  const c = router.spec.template.spec.containers[0];
  // The kubelet has no client certificate: TCP probes (a gRPC probe speaks no TLS either).
  assert.deepEqual(c.readinessProbe, { tcpSocket: { port: 'http' }, periodSeconds: 5, failureThreshold: 3 });
  assert.deepEqual(c.livenessProbe, { tcpSocket: { port: 50051 }, periodSeconds: 10, failureThreshold: 6 });
  for (const w of workloads(withSameSecret)) assert.equal(flag(w, 'internal-tls-ca-certs'), undefined, 'internal TLS is separate');
  router = component(withOwnCa, 'router');
  assert.deepEqual(secretFile(router, flag(router, 'ssl-ca-certs')), { secret: 'duet-client-ca', key: 'ca.crt', readOnly: true });
  const routerTls = router.spec.template.spec.volumes.find((v) => v.secret?.secretName === 'duet-router-tls');
  assert.deepEqual(routerTls.secret.items.map((i) => i.key), ['tls.crt', 'tls.key'], 'ca.crt is not needed from it');
});

// ---- values the chart refuses ------------------------------------------------------------------

function refuses(values, reason) {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'duet-chart-'));
  const file = path.join(dir, 'values.yaml');
  fs.writeFileSync(file, values);
  const result = render([file]);
  fs.rmSync(dir, { recursive: true });
  assert.notEqual(result.status, 0, `rendered values it should refuse:\n${values}`);
  assert.match(result.stderr, reason);
}

test('values the schema refuses', () => {
  refuses('decode: {replicas: -1}\n', /decode\.replicas: Must be greater than or equal to 0/);
  refuses('decode: {gpus: 2}\n', /Additional property gpus is not allowed/);
  refuses('backend: tpu\n', /backend must be one of the following/);
  refuses('modelArtifacts: {source: s3}\n', /modelArtifacts\.source must be one of the following/);
  refuses('prefill: {parallelism: {sequence: 0}}\n', /prefill\.parallelism\.sequence: Must be greater than or equal to 1/);
  refuses('router: {grpcPort: 70000}\n', /router\.grpcPort: Must be less than or equal to 65535/);
  refuses('router: {localPrefillMaxTokens: -1}\n', /router\.localPrefillMaxTokens: Must be greater than or equal to 0/);
  refuses('tls: {internal: {secretName: x}}\n', /Additional property secretName is not allowed/);
  refuses('tls: {router: {clientCertRequired: "yes"}}\n', /tls\.router\.clientCertRequired: Invalid type\. Expected: boolean/);
});

test('values the chart refuses with its reason', () => {
  refuses('modelArtifacts: {source: pvc}\n', /modelArtifacts\.pvc\.claimName is required/);
  refuses('apiKey: {enabled: true}\n', /apiKey\.value \(or apiKey\.existingSecret\) is required/);
  refuses('backend: cpu\n', /prefill\.gpusPerPod is 1 but backend is cpu/);
  refuses('decode: {terminationGracePeriodSeconds: 30, shutdownGraceSeconds: 30}\n', /must exceed decode\.shutdownGraceSeconds/);
  refuses('tls: {enabled: true, secretName: x}\n', /set router\.ingress\.enabled too/);
  refuses('tls: {router: {enabled: true}}\n', /tls\.router\.enabled needs tls\.router\.existingSecret: a kubernetes\.io\/tls Secret/);
  refuses('tls: {internal: {enabled: true}}\n', /tls\.internal\.enabled needs tls\.internal\.existingSecret: a Secret with tls\.crt, tls\.key and ca\.crt/);
  refuses('tls: {router: {clientCertRequired: true}}\n', /tls\.router\.clientCertRequired needs tls\.router\.enabled/);
  refuses('tls: {router: {enabled: true, existingSecret: s, clientCaSecret: ca}}\n', /tls\.router\.clientCaSecret is only used with tls\.router\.clientCertRequired/);
});

test('the renderer follows Helm: values files merge, null deletes, a template error fails', () => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'duet-chart-'));
  const a = path.join(dir, 'a.yaml');
  const b = path.join(dir, 'b.yaml');
  fs.writeFileSync(a, 'decode: {replicas: 3, nodeSelector: {zone: a}}\n');
  fs.writeFileSync(b, 'decode: {nodeSelector: null}\n');
  const objects = renderObjects([a, b]);
  fs.rmSync(dir, { recursive: true });
  const decode = component(objects, 'decode');
  assert.equal(decode.spec.replicas, 3);
  assert.equal(decode.spec.template.spec.nodeSelector, undefined);
  assert.equal(component(objects, 'prefill').spec.replicas, 1, 'other roles keep their defaults');
  const broken = spawnSync(helmRender, [path.join(here, 'no-such-chart')], { encoding: 'utf8' });
  assert.notEqual(broken.status, 0);
});

test('helm_render refuses a document that is not YAML', () => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'duet-chart-'));
  fs.mkdirSync(path.join(dir, 'templates'));
  fs.writeFileSync(path.join(dir, 'Chart.yaml'), 'apiVersion: v2\nname: t\nversion: 0.1.0\n');
  fs.writeFileSync(path.join(dir, 'values.yaml'), 'x: 1\n');
  fs.writeFileSync(path.join(dir, 'templates', 'bad.yaml'), 'a: {{ .Values.x }}\n  b: [\n');
  const result = spawnSync(helmRender, [dir], { encoding: 'utf8' });
  fs.rmSync(dir, { recursive: true });
  assert.notEqual(result.status, 0);
  assert.match(result.stderr, /t\/templates\/bad\.yaml/);
});

