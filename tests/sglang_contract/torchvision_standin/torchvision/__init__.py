"""Import-only stand-in for torchvision in the SGLang contract-test environment.

PyPI's torchvision wheels are built against CUDA torch and fail to register their operators
next to the CPU torch build; sglang imports torchvision at module level in multimodal code the
contract tests never run. Every `torchvision.*` module and attribute exists here; calling
anything raises.
"""

import importlib.abc
import importlib.machinery
import sys
import types


class _Meta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Meta(name, (_Stub,), {})


class _Stub(metaclass=_Meta):
    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"torchvision stand-in: {type(self).__name__} is not available")


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Meta(name, (_Stub,), {})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
sys.modules[__name__].__class__ = _Module
__version__ = "0.0.0+stand-in"
