# Type stub for the compiled extension (csrc/python/bindings.cpp): its names are typed Any.
from typing import Any

def __getattr__(name: str) -> Any: ...
