"""A fake of RunPod's REST API v2 on 127.0.0.1 for tests. Every request is checked against
`runpod_v2_contract.json` (written from RunPod's published OpenAPI v2 description) and rejected as the real
API would: unknown fields or values of the wrong type (422), a network volume on Community Cloud or in another
data center (400), an action the pod's status does not allow (409), the cross-field rules of a create
(`contract_rules`), a create on an empty account (402). Errors are RFC 9457 problem bodies; every pod it
answers has a status the contract knows. A test can take it down for a while on its own clock (`down`), refuse
a start for want of free GPUs, and serve a pod's container log (`logs`) as the logs endpoint's Server-Sent
Events."""
import json, re, threading, time, urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

CONTRACT = json.loads((Path(__file__).parent/'runpod_v2_contract.json').read_text())
ENUMS, SCHEMAS = CONTRACT['enums'], CONTRACT['schemas']
CAPACITY = "There are no longer any instances available with the requested specifications (no capacity)."
GPUS = {'NVIDIA H100 80GB HBM3': (80, 2.69, 8), 'NVIDIA GeForce RTX 4090': (24, 0.69, 8),
        'NVIDIA A100 80GB PCIe': (80, 1.64, 8), 'NVIDIA B200': (180, 5.99, 8)}
# id -> has network volumes
DATA_CENTERS = {'EU-RO-1': True, 'US-KS-2': True, 'US-TX-3': True, 'CA-MTL-1': False}
_TYPES = dict(string=str, integer=int, boolean=bool, object=dict, array=list, null=type(None))


def violations(schema, v, path='$'):
    """What in `v` breaks `schema` (the contract's JSON-schema subset), as messages like the real API's
    `errors`."""
    if '$ref' in schema: return violations(SCHEMAS[schema['$ref']], v, path)
    out = []
    if 'enum' in schema:
        allowed = ENUMS[schema['enum']] if isinstance(schema['enum'], str) else schema['enum']
        return [] if v in allowed else [f"{path}: value must be one of {allowed}"]
    types = schema.get('type')
    if types:
        ts = types if isinstance(types, list) else [types]
        ok = any(isinstance(v, _TYPES[t]) and not (t == 'integer' and isinstance(v, bool)) for t in ts)
        if not ok: return [f"{path}: expected {' or '.join(ts)}, got {type(v).__name__}"]
    if isinstance(v, str):
        if len(v) < schema.get('minLength', 0): out.append(f"{path}: length must be >= {schema['minLength']}")
        if 'pattern' in schema and not re.search(schema['pattern'], v):
            out.append(f"{path}: does not match {schema['pattern']}")
    if isinstance(v, int) and not isinstance(v, bool):
        if 'minimum' in schema and v < schema['minimum']:
            out.append(f"{path}: must be >= {schema['minimum']}")
        if 'maximum' in schema and v > schema['maximum']:
            out.append(f"{path}: must be <= {schema['maximum']}")
    if isinstance(v, dict):
        props = schema.get('properties', {})
        for k in schema.get('required', []):
            if k not in v: out.append(f"{path}: missing property '{k}'")
        for k, x in v.items():
            if k in props: out += violations(props[k], x, f"{path}.{k}")
            elif 'values' in schema: out += violations(schema['values'], x, f"{path}.{k}")
            elif schema.get('additional') is False:
                out.append(f"{path}: additional properties '{k}' not allowed")
    if isinstance(v, list):
        if len(v) > schema.get('maxItems', 10**9): out.append(f"{path}: at most {schema['maxItems']} items")
        for i, x in enumerate(v): out += violations(schema.get('items', {}), x, f"{path}[{i}]")
    return out


class Problem(Exception):
    def __init__(self, status, detail, errors=None, headers=None):
        self.status, self.detail, self.errors, self.headers = status, detail, errors, headers or {}


TITLES = {400: 'Bad Request', 401: 'Unauthorized', 402: 'Payment Required', 404: 'Not Found',
          405: 'Method Not Allowed',
          409: 'Conflict', 422: 'Unprocessable Entity', 429: 'Too Many Requests', 503: 'Service Unavailable'}


class FakeRunPodV2:
    "State and behaviour of the fake; `requests` records (method, path, headers, body) of every call."
    def __init__(self, key='rpa_TESTKEY123'):
        self.key, self.requests, self.pods = key, [], {}
        self.volumes = {'vol123abc': dict(id='vol123abc', name='data', size=200, dataCenter='EU-RO-1',
                                          type='STANDARD')}
        self.capacity_failures = 0      # creates answered 400 "no capacity" before one succeeds
        self.lose_next_answer = False   # the next create makes the pod, then answers 502 with HTML
        self.polls_until_running = 0    # GETs of a pod answered PROVISIONING/STARTING before RUNNING
        self.busy = 0                   # the next calls answered 429 (Retry-After: 0)
        self.broken = 0                 # the next calls answered 503
        self.echo_errors = False        # creates fail with a problem that quotes the whole body
        self.ssh = ('203.0.113.7', 40022)  # the public address of a running pod's sshd
        self.n = 0
        self.lock = threading.Lock()
        # (GPU id, data center) -> AvailabilityLevel of a pod of one GPU (default: HIGH everywhere)
        self.stock = {}
        self.query = {}                 # the query of the call being answered
        self.clock = time.monotonic     # the fake's time (a test may run it faster than real time)
        # until then (on `clock`) every call finds no server: the connection drops
        self.down_until = 0.0
        self.down_next = 0              # an outage of this many seconds that the next call starts
        self.unanswered = 0             # calls dropped while down
        self.balance = 100.0            # dollars on the account: a create at 0 is answered 402
        self.no_free_gpus = False       # a start finds no free GPU on the pod's machine
        self.logs = {}                  # pod id -> a file whose lines are the container's stdout
        # the account's SSH public keys
        self.ssh_keys = ['ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFAKEKEYFORTESTS me@laptop']

    def down(self, seconds, from_next_call=False):
        "Be unreachable for `seconds` on the fake's clock, from now or from the next call on."
        if from_next_call: self.down_next = seconds
        else: self.down_until = self.clock() + seconds

    def calls(self, method=None, path=None):
        "Recorded (method, path, body) of the calls matching `method` and a `path` regex."
        return [(m, p, b) for m, p, h, b in self.requests if (method is None or m == method)
                and (path is None or re.fullmatch(path, p))]

    def add_pod(self, pod_id, name='pod', status='RUNNING', **kw):
        body = dict(name=name, image='runpod/pytorch:x', gpu=dict(id='NVIDIA H100 80GB HBM3', count=1),
                    cloud='SECURE', env={}, mounts={}) | kw
        self.pods[pod_id] = self._pod(pod_id, body, status)
        return self.pods[pod_id]

    def handle(self, method, raw_path, headers, raw):
        path, _, query = raw_path.partition('?')
        body = None
        if raw:
            try: body = json.loads(raw)
            except ValueError: return self.problem(Problem(400, 'request body is not JSON'))
        with self.lock:
            if self.down_next: self.down_until, self.down_next = self.clock() + self.down_next, 0
            if self.clock() < self.down_until: self.unanswered += 1; return 0, None, {}
            self.requests.append((method, path, dict(headers), body))
            try:
                if headers.get('Authorization') != f'Bearer {self.key}':
                    raise Problem(401, 'missing or invalid bearer token')
                if self.busy: self.busy -= 1; raise Problem(429, 'rate limit exceeded',
                                                            headers={'Retry-After': '0'})
                if self.broken: self.broken -= 1; raise Problem(503, 'upstream unavailable')
                op, args = self.route(method, path)
                spec = CONTRACT['operations'][op]
                unknown = set(urllib.parse.parse_qs(query)) - set(spec.get('query', []))
                if unknown:
                    raise Problem(422, 'Request validation failed.',
                                  [f"query: unknown parameter '{k}'" for k in sorted(unknown)])
                self.query = {k: v[-1] for k, v in urllib.parse.parse_qs(query).items()}
                if 'body' in spec:
                    errs = violations({'$ref': spec['body']},
                                      body) if body is not None else ['$: request body is required']
                    if errs: raise Problem(422, 'Request validation failed.', errs)
                elif body is not None:
                    raise Problem(422, 'Request validation failed.', ['$: this operation takes no body'])
                handler = op.split()[0].lower() + '_' + re.sub(r'\W+', '_', op.split()[1][4:]).strip('_')
                status, out = getattr(self, handler)(*args, body=body)
                if isinstance(out, dict) and 'status' in out:
                    assert out['status'] in ENUMS['PodStatus'], out['status']
                return status, out, {}
            except Problem as p: return self.problem(p)
            except _Lost: return 502, None, {}

    def problem(self, p):
        body = dict(title=TITLES.get(p.status, 'Error'), status=p.status, detail=p.detail)
        if p.errors: body['errors'] = p.errors
        return p.status, body, dict(p.headers, **{'Content-Type': 'application/problem+json'})

    def route(self, method, path):
        for op in CONTRACT['operations']:
            m, tmpl = op.split()
            rx = '^' + re.sub(r'\\\{id\\\}', '([^/]+)', re.escape(tmpl)) + '$'
            if (mt := re.match(rx, path)) and m == method:
                return op, [urllib.parse.unquote(g) for g in mt.groups()]
        if any(re.match('^' + re.sub(r'\\\{id\\\}', '([^/]+)', re.escape(o.split()[1])) + '$', path)
               for o in CONTRACT['operations']):
            raise Problem(405, 'The requested method is not allowed for this path.')
        raise Problem(404, f'no route {path}')

    # --- operations ---
    def _pod(self, pod_id, body, status, dc='EU-RO-1'):
        gid, count = body['gpu']['id'], body['gpu'].get('count', 1)
        return dict(id=pod_id, name=body['name'], image=body.get('image', ''), args=body.get('args', ''),
                    disk=body.get('disk', 50),
                    ports=body.get('ports', []), env=body.get('env', {}), registry=None, status=status,
                    actions=[], mounts=body.get('mounts', {}),
                    gpu=dict(id=gid, count=count), cloud=body.get('cloud', 'SECURE'), dataCenterId=dc,
                    cudaVersion='12.8',
                    ssh=dict(proxy=None, direct=None), template=None,
                    cost=round(GPUS.get(gid, (0, 1.0))[1]*count, 2), locked=False,
                    globalNetworking=dict(enabled=False), runtime=None, createdAt='2026-11-26T12:00:00Z',
                    startedAt=None, body=body, polls=0)

    def view(self, p):
        p = dict(p)
        p['actions'] = CONTRACT['actions_by_status'].get(p['status'], [])
        if p['status'] == 'RUNNING':
            host, port = self.ssh
            p['ssh'] = dict(proxy=None,
                            direct=dict(host=host, port=port, username='root',
                                        command=f'ssh root@{host} -p {port}'))
            p['runtime'] = dict(uptime=3725, gpus=[dict(util=97, memoryUtil=71)],
                                ports=[dict(private=22, public=port, type='tcp', ip=host)])
        else: p['cost'] = 0.0 if p['status'] in ('EXITED', 'TERMINATED') else p['cost']
        return {k: v for k, v in p.items() if k not in ('body', 'polls')}

    def get_pods(self, body=None): return 200, dict(pods=[self.view(p) for p in self.pods.values()])

    def post_pods(self, body):
        if self.echo_errors: raise Problem(400, f'cannot place pod: {json.dumps(body)}')
        if ('gpu' in body) == ('cpu' in body): raise Problem(400, 'exactly one of gpu or cpu must be set')
        self.contract_rules(body)
        if self.balance <= 0: raise Problem(402, 'insufficient balance: add funds to deploy')
        if 'image' not in body and 'templateId' not in body:
            raise Problem(422, 'Request validation failed.', ["$: missing property 'image'"])
        mounts = body.get('mounts', {})
        if 'persistent' in mounts and 'network' in mounts:
            raise Problem(400, 'at most one of mounts.persistent and mounts.network')
        gid = body['gpu']['id']
        if gid not in GPUS: raise Problem(400, f"gpu type '{gid}' is not a known GPU type")
        dc = (body.get('dataCenterIds') or ['EU-RO-1'])[0]
        for nm in mounts.get('network', []):
            vol = self.volumes.get(nm['volumeId'])
            if vol is None: raise Problem(400, f"network volume {nm['volumeId']} not found")
            if body.get('cloud', 'SECURE') != 'SECURE':
                raise Problem(400, 'network volumes are available on Secure Cloud only')
            if body.get('dataCenterIds') and vol['dataCenter'] not in body['dataCenterIds']:
                raise Problem(400,
                              f"network volume {vol['id']} is in {vol['dataCenter']}, not "
                              f"in {', '.join(body['dataCenterIds'])}")
            dc = vol['dataCenter']
        if self.capacity_failures: self.capacity_failures -= 1; raise Problem(400, CAPACITY)
        self.n += 1
        pod = self.pods[f'pod{self.n:04d}xyz'] = self._pod(f'pod{self.n:04d}xyz', body, 'PROVISIONING', dc)
        if self.lose_next_answer: self.lose_next_answer = False; raise _Lost()
        return 201, self.view(pod)

    def contract_rules(self, body):
        """The cross-field rules of a create that the schema alone does not carry (400), from the contract and
        the pod docs."""
        gpu, mounts = body.get('gpu') or {}, body.get('mounts') or {}
        if gpu.get('allowedCudaVersions') and gpu.get('minCudaVersion'):
            raise Problem(400, 'gpu.allowedCudaVersions and gpu.minCudaVersion are mutually exclusive')
        if 'cpu' in body and 'persistent' in mounts:
            raise Problem(400, 'mounts.persistent is invalid for a CPU pod')
        if len(body.get('env') or {}) > 50: raise Problem(400, 'a pod takes at most 50 environment variables')
        if any(p.endswith('/udp') for p in body.get('ports') or []):
            raise Problem(400, 'pods do not support UDP ports')
        if gpu.get('id') in GPUS and gpu.get('count', 1) > GPUS[gpu['id']][2]:
            raise Problem(400, f"at most {GPUS[gpu['id']][2]} x {gpu['id']} in one pod")

    def get_pods_id_logs(self, pod_id, body=None):
        "The pod's container log as Server-Sent Events, the last `tail` lines (default 100)."
        if pod_id not in self.pods: raise Problem(404, 'pod not found')
        f = self.logs.get(pod_id)
        lines = Path(f).read_text().splitlines() if f and Path(f).is_file() else []
        tail = int(self.query.get('tail', 100))
        ev = [json.dumps(dict(ts=f'2026-11-26T12:00:{i % 60:02d}Z', source='container', line=l)) for i,
              l in enumerate(lines)]
        return 200, Stream(''.join(f'id: {i}\ndata: {e}\n\n' for i,
                                   e in enumerate(ev[len(ev) - tail if tail else len(ev):])))

    def get_account_ssh_keys(self, body=None): return 200, dict(keys=list(self.ssh_keys))

    def get_pods_id(self, pod_id, body=None):
        p = self.pods.get(pod_id)
        if p is None: raise Problem(404, 'pod not found')
        if p['status'] in ('PROVISIONING', 'STARTING'):
            p['polls'] += 1
            p['status'] = 'RUNNING' if p['polls'] > self.polls_until_running else 'STARTING'
        return 200, self.view(p)

    def delete_pods_id(self, pod_id, body=None):
        if self.pods.pop(pod_id, None) is None: raise Problem(404, 'pod not found')
        return 204, None

    def post_pods_id_action(self, pod_id, body):
        p = self.pods.get(pod_id)
        if p is None: raise Problem(404, 'pod not found')
        a = body['action']
        if a not in CONTRACT['actions_by_status'].get(p['status'], []):
            raise Problem(409, f"cannot {a} a pod that is {p['status']}")
        if a == 'terminate': del self.pods[pod_id]; return 204, None
        if a == 'start' and self.no_free_gpus:
            raise Problem(400, 'There are not enough free GPUs on the host machine to start this pod.')
        p['status'] = dict(stop='EXITED', start='STARTING', restart='STARTING')[a]
        p['polls'] = 0
        return 200, self.view(p)

    def get_network_volumes(self, body=None): return 200, dict(networkVolumes=list(self.volumes.values()))

    def get_network_volumes_id(self, vol_id, body=None):
        if vol_id not in self.volumes: raise Problem(404, 'network volume not found')
        return 200, self.volumes[vol_id]

    def post_network_volumes(self, body):
        if not DATA_CENTERS.get(body['dataCenter']):
            raise Problem(400, f"data center {body['dataCenter']} does not offer network volumes")
        v = dict(id=f'vol{len(self.volumes):03d}new', name=body['name'], size=body['size'],
                 dataCenter=body['dataCenter'], type=body.get('type', 'STANDARD'))
        self.volumes[v['id']] = v
        return 201, v

    def get_catalog_gpus(self, body=None): return 200, dict(gpus=[self.gpu(k) for k in GPUS])
    def get_catalog_gpus_id(self, gid, body=None):
        if gid not in GPUS: raise Problem(404, 'gpu type not found')
        q, g = self.query, self.gpu(gid)
        if 'include' not in q:
            if set(q) & {'product', 'count', 'cloud', 'countryCodes', 'cudaVersions', 'minCudaVersion'}:
                raise Problem(400,
                              'product, count, cloud and the other availability filters are valid only with '
                              'include=AVAILABILITY')
            return 200, g
        if q['include'] not in ENUMS['CatalogInclude'] or q.get('product') not in ENUMS['Product']:
            raise Problem(400, 'include=AVAILABILITY requires product (POD, CLUSTER or SERVERLESS)')
        if (q.get('cloud', 'SECURE') not in ENUMS['GpuCloudFilter'] or not q.get('count', '1').isdigit()
                or int(q.get('count', '1')) < 1):
            raise Problem(400, 'cloud must be SECURE or COMMUNITY and count an integer >= 1')
        levels = ENUMS['AvailabilityLevel']
        dcs = [dict(id=dc, name=dc, availability=self.stock.get((gid, dc), 'HIGH')) for dc in DATA_CENTERS]
        dcs = [d for d in dcs if d['availability'] != 'NONE']
        best = max((levels.index(d['availability']) for d in dcs), default=0)
        return 200, dict(g, availability=levels[best], **(dict(dataCenters=dcs) if dcs else {}))
    def gpu(self, gid):
        mem, price, most = GPUS[gid]
        return dict(id=gid, name=gid.split()[-1], pool=None, manufacturer='NVIDIA', memory=mem, secure=True,
                    community=True,
                    price=dict(secure=price, community=round(price*0.7, 2)),
                    maxCount=dict(secure=most, community=most))

    def get_catalog_datacenters(self, body=None):
        return 200, dict(dataCenters=[dict(id=k, name=k, region='EUROPE', globalNetwork=False, compliance=[],
                                           networkVolumeTypes=['STANDARD'] if v else []) for k,
                                      v in DATA_CENTERS.items()])


class _Lost(Exception): pass


class Stream(str): "A text/event-stream body."


def serve(fake, port=0):
    "Start `fake` on `port` (0: a free one) of 127.0.0.1 in a thread; (server, base URL)."
    class H(BaseHTTPRequestHandler):
        def _any(self):
            n = int(self.headers.get('Content-Length') or 0)
            code, out, hdrs = fake.handle(self.command, self.path, self.headers, self.rfile.read(n) if n
                                          else b'')
            if code == 0: self.close_connection = True; return  # down: the connection drops unanswered
            data = (b'' if code == 204 else out.encode() if isinstance(out, Stream)
                    else json.dumps(out).encode() if out is not None
                    else b'<html>502 Bad Gateway</html>')
            self.send_response(code)
            kind = ('text/event-stream' if isinstance(out, Stream)
                    else 'application/json' if out is not None else 'text/html')
            hdrs = dict({'Content-Type': kind}, **hdrs)
            for k, v in hdrs.items(): self.send_header(k, v)
            self.send_header('Content-Length', str(len(data))); self.end_headers(); self.wfile.write(data)
        do_GET = do_POST = do_DELETE = do_PATCH = _any
        def log_message(self, *a): pass
    srv = ThreadingHTTPServer(('127.0.0.1', port), H)
    threading.Thread(target=srv.serve_forever, kwargs=dict(poll_interval=0.05), daemon=True).start()
    return srv, f'http://127.0.0.1:{srv.server_port}'


def main():
    """Run the fake on 127.0.0.1 until killed (the pod rehearsal uses it as RunPod); every call is appended to
    CALLS as a JSON line."""
    import argparse, signal, sys
    ap = argparse.ArgumentParser()
    ap.add_argument('--port', type=int, default=0)
    ap.add_argument('--key', required=True); ap.add_argument('--pod', required=True)
    ap.add_argument('--calls', required=True,
                    help='append every request here, one JSON object a line, with its time')
    a = ap.parse_args()
    fake = FakeRunPodV2(a.key)
    fake.add_pod(a.pod, name='rehearsal')
    real = fake.handle
    def logged(method, path, headers, raw):
        out = real(method, path, headers, raw)
        rec = dict(t=time.time(), method=method, path=path.split('?')[0], status=out[0],
                   body=json.loads(raw) if raw else None)
        with open(a.calls, 'a') as f: f.write(json.dumps(rec) + '\n')
        return out
    fake.handle = logged
    srv, url = serve(fake, a.port)
    print(url, flush=True)
    signal.signal(signal.SIGTERM, lambda *x: sys.exit(0))
    threading.Event().wait()


if __name__ == '__main__': main()
