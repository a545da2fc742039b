"""`lmbook docs` builds the site offline, with the pages the module docstrings link to; then a real browser
(headless Chromium, where installed) reads it over http: every page loads, each module's API reference is
there, images show, search finds pages, no internal link is broken. Screenshots of the home page and a
module page are written to the folder the test prints (or to $LMBOOK_SCREENSHOTS)."""
import base64, functools, http.server, importlib, json, os, re, select, shutil, subprocess, threading, time
from pathlib import Path
from urllib.parse import urlsplit, unquote
import pytest
from conftest import ROOT, lmbook_cmd

pytest.importorskip('smalldocs')
DOCS = re.compile(r'^Docs: https://lmbook\.github\.io/lmbook/([\w.-]+)\.html\.md$', re.M)


def module_pages() -> dict[str, str]:
    "lmbook module -> the page its docstring links to."
    out = {}
    for f in sorted((ROOT/'lmbook').glob('[a-z]*.py')):
        m = DOCS.search(importlib.import_module(f'lmbook.{f.stem}').__doc__ or '')
        assert m, f"lmbook.{f.stem}'s docstring has no Docs: link"
        out[f'lmbook.{f.stem}'] = m.group(1)
    return out


def api_names(mod: str) -> list[str]:
    "The functions and classes `mod` exports (nbdev documents each with a heading of its name)."
    import inspect
    m = importlib.import_module(mod)
    return [n for n in getattr(m, '__all__', [])
            if (inspect.isfunction(getattr(m, n)) or inspect.isclass(getattr(m, n)))
            and getattr(getattr(m, n), '__module__', '') == mod]


@pytest.fixture(scope='module')
def site(tmp_path_factory):
    "The site, built once by the `lmbook docs` command into a scratch folder."
    before = subprocess.run(['git', 'status', '--porcelain'], cwd=ROOT, capture_output=True, text=True).stdout
    out = tmp_path_factory.mktemp('docs')/'_docs'
    t0 = time.time()
    r = lmbook_cmd('docs', '--out', out, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    print(f"lmbook docs: {time.time()-t0:.1f} s")
    assert 'warning' not in r.stderr, r.stderr   # smalldocs' broken links and unread Markdown
    after = subprocess.run(['git', 'status', '--porcelain'], cwd=ROOT, capture_output=True, text=True).stdout
    assert after == before, f"building the docs changed tracked files:\n{after}"
    return out


def test_pages_match_docstring_links(site):
    for mod, page in module_pages().items():
        assert (site/f'{page}.html').is_file(), \
            f"{mod} links to {page}.html.md but the site has no {page}.html"
        md = (site/f'{page}.html.md').read_text()
        for name in api_names(mod): assert f'### {name}' in md, f"{mod}.{name} is missing from {page}.html.md"
    assert (site/'index.html').is_file() and (site/'search.json').is_file()
    llms = (site/'llms.txt').read_text()
    assert 'https://lmbook.github.io/lmbook/core.html.md' in llms and '.llms.md' not in llms
    # run notebooks are not pages: train.html and analysis.html are module pages
    assert 'from whatever data is missing' not in (site/'train.html').read_text()
    assert 'Analysis of runs' not in (site/'analysis.html').read_text()


def sidebar_labels(page:str) -> list[str]:
    "What the sidebar of a built page says, entry by entry (sections and pages), in order."
    bar = page[page.index('sidebar-menu-container'):]
    return re.findall(r'<span class="menu-text">([^<]*)</span>', bar[:bar.index('</nav>')])


def test_the_sidebar_names_each_entry_once(site):
    "No two entries of the sidebar read the same (a chapter is its section's name, a module its own)."
    from collections import Counter
    labels = sidebar_labels((site/'index.html').read_text())
    assert {'data', 'corpus', 'prepare', 'gpt', 'find', 'Benchmarks'} <= set(labels), labels
    twice = {k: n for k, n in Counter(l.lower() for l in labels).items() if n > 1}
    assert not twice, (twice, labels)


def test_site_links_resolve_and_name_only_declared_repositories(site):
    """Every href and src of the site's pages, and every link of their Markdown copies, opens a file the site
    has (the raw benchmark results included) or a repository pyproject.toml declares."""
    from test_links import site_problems
    bad = site_problems(site)
    assert not bad, '\n'.join(bad[:30])
    raw = 'benchmarks/results/levers_2026-11-26_h100.jsonl'
    assert f'href="{raw}"' in (site/'benchmarks.html').read_text() and (site/raw).is_file()
    # source links open the site's own copy of the module, at the line, not a code host
    pages = [p.read_text() for p in site.glob('*.html')]
    assert not any('href="https://github.com/' in t for t in pages)
    launch = (site/'launch.html').read_text()
    line = int(launch.split('href="src/lmbook/train/launch.py.html#L', 1)[1].split('"', 1)[0])
    src = (site/'src'/'lmbook'/'train'/'launch.py.html').read_text()
    assert f'<span id="L{line}">def ' in src or f'<span id="L{line}">class ' in src


def test_serve_an_up_to_date_site_without_rebuilding(site):
    "`lmbook docs --serve` with nothing changed since the build serves the site at once."
    import sys, urllib.request
    p = subprocess.Popen([str(Path(sys.executable).parent/'lmbook'), 'docs', '--out', str(site), '--serve',
                          '--port', '0'],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.time()
        first, second = p.stdout.readline(), p.stdout.readline()
        assert ('is up to date' in first and second.startswith('serving')
                and time.time() - t0 < 15), (first, second)
        port = int(re.search(r':(\d+)/', second).group(1))
        assert urllib.request.urlopen(f'http://127.0.0.1:{port}/index.html', timeout=10).status == 200
    finally:
        p.terminate(); p.wait(10)


def test_refuses_to_empty_a_folder_that_is_not_a_site(site, tmp_path):
    mine = tmp_path/'mine'; mine.mkdir(); (mine/'notes.txt').write_text('keep')
    r = lmbook_cmd('docs', '--out', mine)
    assert r.returncode == 2 and r.stderr.startswith('error: ') and 'not a built site' in r.stderr, r.stderr
    assert (mine/'notes.txt').read_text() == 'keep' and len(list(mine.iterdir())) == 1


# ---------------------------------------------------------------- the browser

def chromium() -> str | None:
    return shutil.which('chromium') or shutil.which('chromium-browser') or shutil.which('google-chrome')


class Chromium:
    """Headless Chromium driven over the DevTools protocol on a pipe (fd 3 in, fd 4 out; no websocket, no
    Node)."""
    def __init__(self, exe, profile, size=(1280, 900)):
        to_r, self._w = os.pipe(); self._r, from_w = os.pipe()
        def fds():  # in the child: the pipe ends Chromium expects, inheritable
            a, b = os.dup(to_r), os.dup(from_w)
            os.dup2(a, 3); os.dup2(b, 4)
        args = [exe, '--headless', '--no-sandbox', '--disable-gpu', '--no-first-run',
                '--disable-background-networking',
                '--disable-component-update', '--disable-sync', '--hide-scrollbars',
                f'--user-data-dir={profile}',
                '--remote-debugging-pipe', f'--window-size={size[0]},{size[1]}', 'about:blank']
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, preexec_fn=fds, close_fds=False)
        os.close(to_r); os.close(from_w)
        self._id, self._buf, self.events = 0, b'', []

    def _read(self, timeout):
        while b'\0' not in self._buf:
            if not select.select([self._r], [], [], timeout)[0]:
                raise TimeoutError('no message from chromium')
            chunk = os.read(self._r, 1 << 20)
            if not chunk: raise RuntimeError('chromium closed the pipe')
            self._buf += chunk
        msg, self._buf = self._buf.split(b'\0', 1)
        return json.loads(msg)

    def send(self, method, session=None, timeout=30, **params):
        self._id += 1
        msg = dict(id=self._id, method=method, params=params, **({'sessionId': session} if session else {}))
        os.write(self._w, json.dumps(msg).encode() + b'\0')
        end = time.time() + timeout
        while True:
            m = self._read(max(0.01, end - time.time()))
            if m.get('id') == self._id:
                if 'error' in m: raise RuntimeError(f"{method}: {m['error']}")
                return m.get('result', {})
            self.events.append(m)

    def wait_event(self, method, session, timeout=30):
        end = time.time() + timeout
        while True:
            for i, m in enumerate(self.events):
                if m.get('method') == method and m.get('sessionId') == session: return self.events.pop(i)
            self.events.append(self._read(max(0.01, end - time.time())))

    def close(self):
        try: self.send('Browser.close', timeout=5)
        except Exception: pass
        try: self.proc.wait(10)
        except subprocess.TimeoutExpired: self.proc.kill(); self.proc.wait()
        os.close(self._w); os.close(self._r)


class Tab:
    """One page of the browser: open a URL, run JavaScript, take a screenshot; failed requests and errors are
    kept."""
    def __init__(self, browser):
        self.b = browser
        tid = browser.send('Target.createTarget', url='about:blank')['targetId']
        self.s = browser.send('Target.attachToTarget', targetId=tid, flatten=True)['sessionId']
        for d in ('Page', 'Runtime', 'Network'): browser.send(f'{d}.enable', self.s)

    def open(self, url):
        "Load `url`; return [problems]: failed requests, http errors, uncaught exceptions."
        self.b.events.clear()
        self.b.send('Page.navigate', self.s, url=url)
        self.b.wait_event('Page.loadEventFired', self.s)
        time.sleep(0.2)   # deferred scripts
        self.js('0')      # drains the events that came before
        bad, urls = [], {}
        for m in self.b.events:
            p = m.get('params', {})
            if m.get('method') == 'Network.requestWillBeSent': urls[p['requestId']] = p['request']['url']
            if m.get('method') == 'Network.loadingFailed' and not p.get('canceled'):
                bad.append(f"{p.get('errorText')} {urls.get(p['requestId'])}")
            if m.get('method') == 'Network.responseReceived' and p['response']['status'] >= 400 \
               and not p['response']['url'].endswith('/favicon.ico'):
                bad.append(f"{p['response']['status']} {p['response']['url']}")
            if m.get('method') == 'Runtime.exceptionThrown':
                bad.append(p['exceptionDetails'].get('exception', {}).get('description', 'exception'))
        return bad

    def js(self, expr):
        r = self.b.send('Runtime.evaluate', self.s, expression=expr, returnByValue=True, awaitPromise=True)
        if 'exceptionDetails' in r: raise RuntimeError(f"{expr[:60]}: {r['exceptionDetails']}")
        return r['result'].get('value')

    def screenshot(self, path):
        Path(path).write_bytes(base64.b64decode(self.b.send('Page.captureScreenshot', self.s,
                                                            format='png')['data']))
        return path


PAGE_FACTS = """(() => ({
  title: document.title,
  headings: [...document.querySelectorAll('main h1, main h2, main h3, main h4')]
    .map(h => h.textContent.trim()),
  ids: [...document.querySelectorAll('[id]')].map(e => e.id),
  links: [...document.querySelectorAll('a[href]')].map(a => a.href),
  imgs: [...document.images].map(i => ({src: i.src.slice(0, 60), ok: i.complete && i.naturalWidth > 0,
                                        out: !!i.closest('.cell-output, .cell-output-display')})),
}))()"""


@pytest.mark.skipif(chromium() is None, reason='no Chromium installed (Debian: apt-get install chromium)')
def test_site_in_a_browser(site, tmp_path):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *a): pass
    httpd = http.server.ThreadingHTTPServer(('127.0.0.1', 0), functools.partial(Quiet, directory=str(site)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    base = f'http://127.0.0.1:{httpd.server_port}/'
    shots = Path(os.environ.get('LMBOOK_SCREENSHOTS') or tmp_path/'screenshots')
    shots.mkdir(parents=True, exist_ok=True)
    b = Chromium(chromium(), tmp_path/'profile')
    try:
        tab = Tab(b)
        facts = {}
        for page in sorted(p.name for p in site.glob('*.html')):
            problems = tab.open(base + page)
            assert not problems, f"{page}: {problems}"
            facts[page] = tab.js(PAGE_FACTS)
            assert facts[page]['headings'], f"{page} shows no content"
            bad = [i['src'] for i in facts[page]['imgs'] if not i['ok']]
            assert not bad, f"{page}: images that do not load: {bad}"
            # code never scrolls sideways in a 1280 px window: long lines wrap (styles.css)
            wide = tab.js("[...document.querySelectorAll('pre.sourceCode, .cell-output pre')]"
                          ".filter(p => p.scrollWidth > p.clientWidth + 1).length")
            assert not wide, f"{page}: {wide} code block(s) or output(s) scroll sideways at 1280 px"
            # a wide table scrolls in its own box rather than being cut off at the column's edge
            cut = tab.js("[...document.querySelectorAll('main table')].filter(t => getComputedStyle(t)"
                         ".overflowX !== 'auto' && t.scrollWidth > t.clientWidth + 1).length")
            assert not cut, f"{page}: {cut} table(s) cut off at 1280 px"
        # each module's API reference: a heading per exported function and class
        for mod, page in module_pages().items():
            missing = set(api_names(mod)) - set(facts[f'{page}.html']['headings'])
            assert not missing, f"{page}.html lacks the API reference of {mod}: {sorted(missing)}"
        # plots: the notebooks' images are on their pages and load (checked above)
        assert (sum(i['out'] for f in facts.values() for i in f['imgs'])
                >= 1), "no notebook output image on any page"
        # no broken internal link: the page exists and so does the anchor
        broken = []
        for page, f in facts.items():
            for href in f['links']:
                u = urlsplit(href)
                if not href.startswith(base): continue
                target = unquote(u.path[len(urlsplit(base).path):]) or 'index.html'
                if target.endswith('/'): target += 'index.html'
                if not (site/target).is_file(): broken.append(f"{page} -> {target}")
                elif u.fragment and target in facts and unquote(u.fragment) not in facts[target]['ids']:
                    broken.append(f"{page} -> {target}#{u.fragment}")
        assert not broken, f"broken internal links: {sorted(set(broken))[:20]}"
        # search over http: type a query the way a reader does and follow the first result
        assert not tab.open(base + 'index.html')
        tab.js("document.querySelector('.smalldocs-search input').focus()")
        b.send('Input.insertText', tab.s, text='checkpoint')
        for _ in range(50):
            hits = tab.js("[...document.querySelectorAll('.search-result')].map(a => "
                          "a.getAttribute('href').replace(/^[.][/]/, ''))")
            if hits: break
            time.sleep(0.1)
        assert hits and any(h.startswith('checkpoint.html') for h in hits), hits
        shot_search = tab.screenshot(shots/'search.png')
        assert not tab.open(base + hits[0])
        # what a reader sees
        assert not tab.open(base + 'index.html'); home = tab.screenshot(shots/'home.png')
        assert not tab.open(base + 'runnb.html'); mod = tab.screenshot(shots/'runnb.png')
        tab.js("document.querySelector('.cell-output img, .cell-output-display "
               "img').scrollIntoView({block: 'center', behavior: 'instant'})")
        time.sleep(0.3)
        plot = tab.screenshot(shots/'runnb-plot.png')
        for p in (home, mod, plot, shot_search): assert p.stat().st_size > 20_000
        print(f"screenshots: {shots}")
    finally:
        b.close(); httpd.shutdown(); httpd.server_close()
