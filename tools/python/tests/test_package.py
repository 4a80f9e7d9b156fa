"""Tests of the kvfs package itself: no mount needed.

It imports without torch, says its version, and tools/kvfs_client.py (the
old module, kept for existing scripts) still re-exports it.
"""

import os
import re
import subprocess
import sys
import textwrap
import unittest

import kvfs
import kvfs.client

# tools/python: the directory that holds the imported package (the source
# tree's, or site-packages when installed).
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(kvfs.__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
PYPROJECT = os.path.join(HERE, os.pardir, "pyproject.toml")
SHIM = os.path.join(HERE, os.pardir, os.pardir, "kvfs_client.py")


def run_python(code, pythonpath):
    """Runs `python -c code` with PYTHONPATH set; returns (rc, output)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        cwd="/",
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        universal_newlines=True,
        timeout=60,
    )
    return out.returncode, out.stdout


# Makes `import torch` (and any torch.*) fail, as on a machine without it.
BLOCK_TORCH = """
    import sys

    class _NoTorch:
        tried = []  # every attempt to import torch, even one that was caught

        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                self.tried.append(name)
                raise ModuleNotFoundError("torch is blocked by this test", name=name)
            return None

    _no_torch = _NoTorch()
    sys.meta_path.insert(0, _no_torch)
"""


class PackageTest(unittest.TestCase):
    def test_imports_without_torch(self):
        rc, out = run_python(
            BLOCK_TORCH
            + """
    import kvfs, kvfs.client
    from kvfs import Kvfs, KvfsError
    assert not _no_torch.tried, "importing kvfs tried to import " + repr(_no_torch.tried)
    assert "torch" not in sys.modules, "torch was imported"
    # register_tensor imports torch only when called, and fails clearly then.
    kv = Kvfs.__new__(Kvfs)
    try:
        kv.register_tensor(None)
    except ImportError:
        print("register_tensor: ImportError")
    print("imported", kvfs.__version__)
    """,
            [PACKAGE_ROOT],
        )
        self.assertEqual(rc, 0, out)
        self.assertIn("register_tensor: ImportError", out)
        self.assertIn("imported " + kvfs.__version__, out)

    def test_no_module_level_torch_import(self):
        # Also statically: no module of the package but the torch ones
        # (kvfs.hf) imports torch outside a function body (module level,
        # class bodies, try/if blocks).
        import ast

        def outside_functions(node):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    continue
                yield child
                yield from outside_functions(child)

        pkg = os.path.dirname(os.path.abspath(kvfs.__file__))
        # Modules that exist for torch users import it; nothing else may.
        torch_modules = {"hf.py", "hf_demo.py"}
        for name in sorted(os.listdir(pkg)):
            if not name.endswith(".py") or name in torch_modules:
                continue
            with open(os.path.join(pkg, name)) as f:
                tree = ast.parse(f.read(), name)
            for node in outside_functions(tree):
                mods = []
                if isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    mods = [node.module or ""]
                for m in mods:
                    self.assertNotEqual(m.split(".")[0], "torch", f"{name} imports {m} at module level")

    def test_version(self):
        self.assertIsInstance(kvfs.__version__, str)
        self.assertRegex(kvfs.__version__, r"^\d+\.\d+\.\d+")
        if not os.path.exists(PYPROJECT):
            self.skipTest("no pyproject.toml beside the tests")
        with open(PYPROJECT) as f:
            m = re.search(r'^version\s*=\s*"([^"]+)"', f.read(), re.M)
        self.assertIsNotNone(m, "no version in pyproject.toml")
        self.assertEqual(kvfs.__version__, m.group(1), "kvfs.__version__ and pyproject.toml disagree")

    def test_public_api(self):
        for name in kvfs.__all__:
            self.assertTrue(hasattr(kvfs, name), name)
        self.assertIs(kvfs.Kvfs, kvfs.client.Kvfs)
        self.assertIs(kvfs.KvfsError, kvfs.client.KvfsError)
        self.assertTrue(issubclass(kvfs.KvfsError, OSError))
        for name in ("register_host_region", "register_cuda_region", "register_tensor", "unregister",
                     "store", "restore", "query", "prefetch", "wait", "encode_entries", "close"):
            self.assertTrue(callable(getattr(kvfs.Kvfs, name)), name)

    def test_errors_and_tickets_without_a_mount(self):
        e = kvfs.KvfsError(34, "layer 99 out of range", 1)
        self.assertEqual((e.errno, e.entry, e.message), (34, 1, "layer 99 out of range"))
        self.assertEqual(str(e), "[errno 34] layer 99 out of range (entry 1)")
        self.assertEqual(str(kvfs.KvfsError(5, "io")), "[errno 5] io")
        t = kvfs.client._ticket(7, "ipc_event=00ff10")
        self.assertEqual((int(t), t.ipc_event_handle), (7, b"\x00\xff\x10"))
        self.assertIsNone(kvfs.client._ticket(8, "").ipc_event_handle)
        with self.assertRaises(ValueError):
            kvfs.client._kind("X")
        with self.assertRaises(ValueError):
            kvfs.Kvfs.__new__(kvfs.Kvfs).register_cuda_region(b"short", 4096)
        with self.assertRaises(FileNotFoundError) as e:
            kvfs.Kvfs(HERE)
        self.assertIn("is not a kvfs mount", str(e.exception))

    @unittest.skipUnless(os.path.exists(SHIM), "tools/kvfs_client.py is not beside the package")
    def test_old_module_still_reexports(self):
        # Only tools/ on the path: the shim must find tools/python itself
        # (or an installed kvfs), and without torch.
        rc, out = run_python(
            BLOCK_TORCH
            + """
    import kvfs_client, kvfs, kvfs.client
    from kvfs_client import Kvfs, KvfsError
    assert not _no_torch.tried, "importing kvfs_client tried to import " + repr(_no_torch.tried)
    assert Kvfs is kvfs.Kvfs and KvfsError is kvfs.KvfsError
    for name in ("Ticket", "Encoded", "STATES", "VERSION", "FOREVER", "NO_ENTRY", "REGISTER_CUDA"):
        assert getattr(kvfs_client, name) is getattr(kvfs.client, name), name
    print("shim ok")
    """,
            [os.path.dirname(os.path.abspath(SHIM))],
        )
        self.assertEqual(rc, 0, out)
        self.assertIn("shim ok", out)


if __name__ == "__main__":
    unittest.main(verbosity=2)
