"""The library's imports run one way (docs/design/architecture.md): no module of ``dflash_jax`` reaches itself
through imports, counting those inside functions (a lazy import is still a dependency), and the target config
(``dflash_jax/config.py``) imports no family and no draft code: families and drafts build on it."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def import_graph(package: str = "dflash_jax") -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its file (``from pkg import mod`` names ``pkg.mod``;
    ``from pkg import name`` names ``pkg``)."""
    paths = {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
             for p in (REPO / package).rglob("*.py")}
    graph = {}
    for mod, path in paths.items():
        here = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here[:len(here) - node.level + 1] + [node.module or ""]) if node.level else node.module
                base = base.rstrip(".")
                subs = {f"{base}.{a.name}" for a in node.names} & set(paths)
                deps |= subs if len(subs) == len(node.names) else subs | {base}
        graph[mod] = {d for d in deps if d in paths and d != mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_in_the_library():
    assert cycles(import_graph()) == []


def test_the_target_config_imports_no_family_and_no_draft():
    deps = import_graph()["dflash_jax.config"]
    assert not {d for d in deps if d.startswith(("dflash_jax.families", "dflash_jax.drafts"))}, deps


def test_the_check_sees_a_circle():
    """Power: a lazy import closing a loop is found (the shape this file guards against: config -> a family ->
    config)."""
    graph = import_graph()
    assert "dflash_jax.config" in graph["dflash_jax.families.gemma4"]
    graph["dflash_jax.config"] = graph["dflash_jax.config"] | {"dflash_jax.families.gemma4"}
    assert any("dflash_jax.config" in c and "dflash_jax.families.gemma4" in c for c in cycles(graph))
