"""A fake RunPod GraphQL API on 127.0.0.1 for tests: it parses what the SDK sends as strictly as a GraphQL
server would."""
import json, re, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CAPACITY = ("There are no longer any instances available with the requested specifications. "
            "Please refresh and try again.")
GPUS = {'NVIDIA H100 80GB HBM3': 80, 'NVIDIA GeForce RTX 4090': 24, 'NVIDIA A100 80GB PCIe': 80}


class GqlSyntaxError(Exception): pass


def parse_value(s, i):
    """Parse one GraphQL input value at s[i:] (strings without escapes, as the SDK writes them); (value, next
    index)."""
    i = skip(s, i)
    c = s[i]
    if c == '"':
        j = s.index('"', i + 1)
        return s[i+1:j], j + 1
    if c == '{':
        obj, i = {}, i + 1
        while True:
            i = skip(s, i)
            if s[i] == '}': return obj, i + 1
            m = re.compile(r'[A-Za-z_]\w*').match(s, i)
            if not m: raise GqlSyntaxError(f"expected a field name at {s[i:i+20]!r}")
            i = skip(s, m.end())
            if s[i] != ':': raise GqlSyntaxError(f"expected ':' after {m.group()!r}")
            obj[m.group()], i = parse_value(s, i + 1)
            i = skip(s, i)
            if s[i] == ',': i += 1
    if c == '[':
        out, i = [], i + 1
        while True:
            i = skip(s, i)
            if s[i] == ']': return out, i + 1
            v, i = parse_value(s, i); out.append(v)
            i = skip(s, i)
            if s[i] == ',': i += 1
    m = re.compile(r'-?\d+(\.\d+)?|true|false|null|[A-Z_]+').match(s, i)
    if not m: raise GqlSyntaxError(f"unexpected {s[i:i+20]!r}")
    t = m.group()
    v = {'true': True, 'false': False, 'null': None}.get(t, t)
    if re.fullmatch(r'-?\d+', t): v = int(t)
    return v, m.end()


def skip(s, i):
    while i < len(s) and s[i] in ' \t\n\r': i += 1
    if i >= len(s): raise GqlSyntaxError("unexpected end of the query")
    return i


def input_of(query, op):
    "The parsed `input: {...}` argument of operation `op`; syntax errors for anything malformed after it."
    m = re.search(op + r'\s*\(\s*input:\s*', query)
    v, i = parse_value(query, m.end())
    if not query[i:].lstrip().startswith(')'): raise GqlSyntaxError(f"expected ')' after the input of {op}")
    bare = re.sub(r'"[^"]*"', '""', query)  # braces inside string values are content, not syntax
    if bare.count('{') != bare.count('}'): raise GqlSyntaxError("unbalanced braces")
    return v


class FakeRunPod:
    "State and behaviour of the fake API; `requests` records (headers, query) of every call."
    def __init__(self, key='rpa_TESTKEY123'):
        self.key, self.requests, self.pods, self.volumes = key, [], {}, [dict(id='vol123abc', name='data',
                                                                              size=200,
                                                                              dataCenterId='EU-RO-1')]
        self.capacity_failures = 0      # creates answered "no instances" before one succeeds
        self.lose_next_answer = False   # next create makes the pod, then answers 500 with HTML
        self.polls_until_running = 0    # pod queries answered CREATED before RUNNING
        # creates fail with an error quoting the whole request, as some servers' syntax errors do
        self.echo_errors = False
        self.n = 0

    def ops(self, name): return [q for h, q in self.requests if name in q]

    def handle(self, headers, body):
        if headers.get('Authorization') != f'Bearer {self.key}': return 401, {'error': 'unauthorized'}
        q = json.loads(body)['query']
        self.requests.append((dict(headers), q))
        if self.echo_errors and 'podFindAndDeployOnDemand' in q:
            return 200, {'errors': [{'message': f'Syntax Error: Unexpected <EOF> in {q!r}'}]}
        try: return 200, {'data': self.answer(q)}
        except GqlSyntaxError as e: return 200, {'errors': [{'message': f'Syntax Error: {e}'}]}
        except LookupError as e: return 200, {'errors': [{'message': str(e)}]}
        except _Lost: return 500, None

    def answer(self, q):
        if 'podFindAndDeployOnDemand' in q:
            inp = input_of(q, 'podFindAndDeployOnDemand')
            known = {'name', 'imageName', 'cloudType', 'startSsh', 'gpuTypeId', 'supportPublicIp', 'gpuCount',
                     'volumeInGb', 'minVcpuCount',
                     'minMemoryInGb', 'dataCenterId', 'dockerArgs', 'containerDiskInGb', 'ports',
                     'volumeMountPath', 'env', 'networkVolumeId', 'templateId'}
            if set(inp) - known: raise GqlSyntaxError(f"unknown input fields {sorted(set(inp) - known)}")
            if inp['gpuTypeId'] not in GPUS: raise LookupError(f"gpu type {inp['gpuTypeId']} not found")
            if inp.get('networkVolumeId') and inp['networkVolumeId'] not in [v['id'] for v in self.volumes]:
                raise LookupError("Network volume not found")
            if self.capacity_failures: self.capacity_failures -= 1; raise LookupError(CAPACITY)
            self.n += 1
            pod = dict(id=f'pod{self.n:04d}xyz', name=inp['name'], desiredStatus='RUNNING',
                       costPerHr=2.69 * inp['gpuCount'],
                       gpuCount=inp['gpuCount'], imageName=inp['imageName'],
                       env=[f"{e['key']}={e['value']}" for e in inp.get('env', [])],
                       uptimeSeconds=0, machine=dict(gpuDisplayName=inp['gpuTypeId']), input=inp, polls=0)
            self.pods[pod['id']] = pod
            if self.lose_next_answer: self.lose_next_answer = False; raise _Lost()
            return {'podFindAndDeployOnDemand': dict(id=pod['id'], imageName=pod['imageName'], env=pod['env'],
                                                     machineId='m1', machine=dict(podHostId='h1'))}
        if re.search(r'gpuTypes\s*\(', q):
            gid = input_of(q, 'gpuTypes')['id']
            return {'gpuTypes': [dict(id=gid, displayName=gid, memoryInGb=GPUS[gid])] if gid in GPUS else []}
        if 'gpuTypes' in q:
            return {'gpuTypes': [dict(id=k, displayName=k, memoryInGb=v) for k, v in GPUS.items()]}
        if re.search(r'\bpod\s*\(', q):
            p = self.pods.get(input_of(q, 'pod')['podId'])
            if p is None: return {'pod': None}
            p['polls'] += 1
            up = p['desiredStatus'] == 'RUNNING' and p['polls'] > self.polls_until_running
            runtime = dict(uptimeInSeconds=3725,
                           ports=[dict(ip='203.0.113.7', isIpPublic=True, privatePort=22, publicPort=40022,
                                       type='tcp')],
                           gpus=[dict(id='GPU-0', gpuUtilPercent=97, memoryUtilPercent=71)]) if up else None
            return {'pod': dict(_public(p), desiredStatus=p['desiredStatus'] if up
                                or p['desiredStatus'] != 'RUNNING' else 'CREATED', runtime=runtime)}
        if 'podStop' in q:
            p = self.pods[input_of(q, 'podStop')['podId']]
            p['desiredStatus'] = 'EXITED'
            return {'podStop': dict(id=p['id'], desiredStatus='EXITED')}
        if 'podResume' in q:
            p = self.pods[input_of(q, 'podResume')['podId']]; p['desiredStatus'] = 'RUNNING'
            return {'podResume': dict(id=p['id'], desiredStatus='RUNNING', imageName=p['imageName'],
                                      env=p['env'], machineId='m1', machine=dict(podHostId='h1'))}
        if 'podTerminate' in q:
            self.pods.pop(input_of(q, 'podTerminate')['podId'])
            return {'podTerminate': None}
        if 'podRestart' in q:
            p = self.pods[input_of(q, 'podRestart')['podId']]
            return {'podRestart': dict(id=p['id'], desiredStatus='RUNNING')}
        if 'createNetworkVolume' in q:
            inp = input_of(q, 'createNetworkVolume')
            v = dict(id=f'vol{len(self.volumes):03d}new', name=inp['name'], size=inp['size'],
                     dataCenterId=inp['dataCenterId'])
            self.volumes.append(v); return {'createNetworkVolume': v}
        if re.search(r'myself\s*\{\s*pods', q):
            return {'myself': {'pods': [_public(p) for p in self.pods.values()]}}
        if 'networkVolumes' in q: return {'myself': dict(id='user1', pubKey='', networkVolumes=self.volumes)}
        raise GqlSyntaxError(f"Cannot query this: {q[:60]!r}")


class _Lost(Exception): pass


def _public(p): return {k: v for k, v in p.items() if k not in ('input', 'polls')}


def serve(fake):
    "Start `fake` on a free port in a thread; (server, base URL)."
    class H(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers['Content-Length']))
            if self.path != '/graphql': code, out = 404, None
            else: code, out = fake.handle(self.headers, body)
            data = json.dumps(out).encode() if out is not None else b'<html>502 Bad Gateway</html>'
            self.send_response(code)
            self.send_header('Content-Type', 'application/json' if out is not None else 'text/html')
            self.send_header('Content-Length', str(len(data))); self.end_headers(); self.wfile.write(data)
        def log_message(self, *a): pass
    srv = ThreadingHTTPServer(('127.0.0.1', 0), H)
    threading.Thread(target=srv.serve_forever, kwargs=dict(poll_interval=0.05), daemon=True).start()
    return srv, f'http://127.0.0.1:{srv.server_port}'
