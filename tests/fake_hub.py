"""A small stand-in for the Hugging Face Hub endpoints an upload uses (create a repository, ask how each file
goes up, commit files sent inline), on 127.0.0.1: `huggingface_hub` itself talks to it through HF_ENDPOINT. It
answers every file 'regular' (inline in the commit), keeps what it got in memory, and records each request's
Authorization header."""
import base64, hashlib, json, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeHub:
    def __init__(self):
        self.repos, self.files, self.auth, self.log = {}, {}, [], []
        hub = self
        class H(BaseHTTPRequestHandler):
            protocol_version = 'HTTP/1.1'
            def log_message(self, *a): pass
            def _send(self, code, obj):
                data = json.dumps(obj).encode()
                self.send_response(code); self.send_header('Content-Type', 'application/json')
                self.send_header('Content-Length', str(len(data))); self.end_headers(); self.wfile.write(data)
            def do_GET(self): hub.seen(self); self._send(*hub.get(self.path))
            def do_POST(self):
                hub.seen(self)
                body = self.rfile.read(int(self.headers.get('Content-Length', 0)))
                self._send(*hub.post(self.path, body, self.headers.get('Content-Type', '')))
        self.srv = ThreadingHTTPServer(('127.0.0.1', 0), H)
        self.url = f"http://127.0.0.1:{self.srv.server_port}"
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def seen(self,
             h): self.auth.append(h.headers.get('Authorization')); self.log.append(f"{h.command} {h.path}")

    def get(self, path):
        if path.startswith('/api/models/') and '/revision/' in path:
            repo = path.split('/api/models/')[1].split('/revision/')[0]
            if repo in self.repos: return 200, dict(id=repo, sha=self.repos[repo], siblings=[])
        return 404, dict(error=f"no route {path}")

    def post(self, path, body, ctype):
        if path == '/api/repos/create':
            d = json.loads(body); repo = f"{d.get('organization') or 'user'}/{d['name']}"
            self.repos.setdefault(repo, '0'*40)
            return 200, dict(url=f"{self.url}/{repo}", name=repo, id=repo)
        if '/preupload/' in path:
            return 200, dict(files=[dict(path=f['path'], uploadMode='regular', shouldIgnore=False)
                                    for f in json.loads(body)['files']])
        if '/commit/' in path:
            repo = path.split('/api/models/')[1].split('/commit/')[0]
            for line in body.decode().splitlines():
                d = json.loads(line)
                if d['key'] == 'file':
                    self.files[(repo, d['value']['path'])] = base64.b64decode(d['value']['content'])
            self.repos[repo] = hashlib.sha1(body).hexdigest()
            return 200, dict(commitUrl=f"{self.url}/{repo}/commit/{self.repos[repo]}",
                             commitOid=self.repos[repo], pullRequestUrl=None)
        return 404, dict(error=f"no route {path}")

    def close(self): self.srv.shutdown(); self.srv.server_close()
