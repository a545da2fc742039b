"""Links that work where the book is read: in a clone, on GitHub and in the offline site. Every Markdown file
of nbs/, every notebook's Markdown cells and README.md link only to files that exist (relative to the page)
and to no repository of this project other than the ones pyproject.toml declares. tests/test_docs.py runs the
same check over the built site."""
import json, re
from pathlib import Path
from urllib.parse import unquote, urlsplit
from conftest import ROOT
try: import tomllib
except ImportError: import tomli as tomllib  # Python 3.10

FENCE = re.compile(r'^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$', re.M | re.S)
INLINE_CODE = re.compile(r'(`+)(?!`).+?(?<!`)\1(?!`)', re.S)
MD_LINK = re.compile(r'!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+["\'(][^)]*)?\)')
AUTOLINK = re.compile(r'<((?:https?|ftp)://[^>\s]+)>')
ATTR = re.compile(r'\b(?:href|src)\s*=\s*["\']([^"\']+)["\']')
BARE_URL = re.compile(r'https?://[^\s<>()\[\]"\'`]+')
CODE_HOSTS = ('github.com', 'gitlab.com', 'bitbucket.org', 'codeberg.org', 'raw.githubusercontent.com')
NOT_FILES = ('#', 'mailto:', 'data:', 'javascript:', 'tel:')


def unindented(text:str) -> str:
    "`text` without its indented code blocks (lines of 4 spaces or a tab, from a blank line on)."
    out, code, blank = [], False, True
    for line in text.split('\n'):
        code = line.startswith(('    ', '\t')) and (code or blank)
        if not code: out.append(line)
        blank = not line.strip()
    return '\n'.join(out)


def prose(text:str) -> str:
    "Markdown `text` without its code (fenced, indented, inline) and comments: what renders as prose."
    text = unindented(FENCE.sub('', text))
    text = re.sub(r'<!--.*?-->', '', text, flags=re.S)
    return INLINE_CODE.sub('', text)


def links(text:str) -> list[str]:
    "The targets of the links in Markdown `text`: [..](..), <url>, href/src attributes and bare URLs."
    t = prose(text)
    found = [m.group(1) for rx in (MD_LINK, AUTOLINK, ATTR) for m in rx.finditer(t)]
    rest = AUTOLINK.sub('', MD_LINK.sub('', ATTR.sub('', t)))
    return found + [u.rstrip('.,;:') for u in BARE_URL.findall(rest)]


def declared() -> tuple[str, list[str]]:
    "(the project's name, the URLs pyproject.toml declares)."
    p = tomllib.loads((ROOT/'pyproject.toml').read_text())['project']
    return p['name'], [u.rstrip('/').removesuffix('.git') for u in p.get('urls', {}).values()]


def undeclared_repository(url:str) -> bool:
    "Whether `url` names a repository of this project (its name or its owner on a code host) not declared."
    name, urls = declared()
    u = urlsplit(url)
    if u.scheme not in ('http', 'https') or u.hostname not in CODE_HOSTS: return False
    owners = {urlsplit(d).path.strip('/').split('/')[0].lower() for d in urls
              if urlsplit(d).hostname in CODE_HOSTS}
    owner, repo = ([p.lower().removesuffix('.git') for p in u.path.strip('/').split('/')] + ['', ''])[:2]
    plain = url.rstrip('/').removesuffix('.git')
    return ((repo == name.lower() or owner in owners)
            and not any(plain == d or plain.startswith(d + '/') for d in urls))


def problems(page:Path, targets:list[str], root:Path) -> list[str]:
    "What is wrong with the links `targets` of `page`: a missing file, an undeclared repository of ours."
    bad = []
    for t in targets:
        if undeclared_repository(t): bad.append(f"{page.relative_to(root)}: {t} is not a repository that "
                                                f"pyproject.toml declares")
        if urlsplit(t).scheme or t.startswith(('//', '/') + NOT_FILES): continue
        path = unquote(urlsplit(t).path)
        target = page.parent/path
        if path.endswith('/'): target = target/'index.html'
        if not target.exists(): bad.append(f"{page.relative_to(root)}: {t} does not exist")
    return bad


def source_pages() -> list[tuple[Path, str]]:
    "(file, Markdown) of every page a reader opens in a clone: nbs/**/*.md, notebooks' Markdown, README.md."
    pages = [(p, p.read_text()) for p in sorted((ROOT/'nbs').rglob('*.md')) + [ROOT/'README.md']]
    for nb in sorted((ROOT/'nbs').rglob('*.ipynb')):
        if '.ipynb_checkpoints' in nb.parts: continue
        cells = json.loads(nb.read_text())['cells']
        pages += [(nb, ''.join(c['source'])) for c in cells if c['cell_type'] == 'markdown']
    return pages


def site_problems(site:Path) -> list[str]:
    "The dead and undeclared links of a built site: its pages' href/src attributes and its Markdown copies."
    bad = []
    for f in sorted(Path(site).rglob('*')):
        if f.suffix == '.html': bad += problems(f, ATTR.findall(f.read_text()), site)
        elif f.suffix == '.md': bad += problems(f, links(f.read_text()), site)
    return bad


def test_source_links_resolve_and_name_only_declared_repositories():
    pages = source_pages()
    assert len(pages) > 100 and any(p.name == 'README.md' for p, _ in pages)
    bad = [b for p, text in pages for b in problems(p, links(text), ROOT)]
    assert not bad, '\n'.join(bad)


def test_the_check_sees_a_dead_link_and_an_undeclared_repository(tmp_path):
    name, urls = declared()
    (tmp_path/'here.md').write_text('x')
    page = tmp_path/'page.md'
    text = ("[ok](here.md) [gone](benchmarks/results/none.jsonl) ![img](lost.png) [up](#top)\n"
            f"[fork](https://github.com/someone/{name}/blob/main/x.py) <https://gitlab.com/{name}/other>\n"
            f"see https://github.com/{name}/{name}-old/tree/main and [ours]({urls[0]}/blob/main/README.md)\n"
            "[nanoGPT](https://github.com/karpathy/nanoGPT) `[code](not-a-link.md)`\n"
            "```\n[in a block](also-not.md) https://github.com/NAME/lmbook.git\n```\n"
            "\n    indented code: [not a link](either.md)\n\n[after it](gone.md)\n")
    bad = problems(page, links(text), tmp_path)
    assert len(bad) == 6, bad
    assert sum('does not exist' in b for b in bad) == 3 and sum('declares' in b for b in bad) == 3, bad
