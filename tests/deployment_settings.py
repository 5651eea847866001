"""What the deployment tests (test_compose.py, test_k8s.py) check a deployment's settings against: each
role's settings class, its gRPC service name, and whether an env-var path names a real field."""

from __future__ import annotations

import importlib
import inspect
import typing

from pydantic import BaseModel

from services.common.config import ServiceSettings


def health_service_name(role: str) -> str:
    """The full gRPC service name the role's grpc.health.v1 reports (from the generated descriptor)."""
    module = importlib.import_module(f"grpo.{role}.v1.{role}_pb2")
    (service,) = module.DESCRIPTOR.services_by_name.values()
    return service.full_name


def settings_class(role: str) -> type[ServiceSettings]:
    """The one ServiceSettings subclass defined in services/<role>/config.py."""
    module = importlib.import_module(f"services.{role}.config")
    found = [
        cls
        for cls in vars(module).values()
        if inspect.isclass(cls) and issubclass(cls, ServiceSettings) and cls.__module__ == module.__name__
    ]
    assert len(found) == 1, f"services/{role}/config.py must define one ServiceSettings subclass: {found}"
    return found[0]


def field_path_error(cls: type[BaseModel], parts: list[str]) -> str | None:
    """None if `parts` (lower-case) name a field, walking into nested models; else why not."""
    model: type[BaseModel] | None = cls
    for depth, part in enumerate(parts):
        if model is None:
            return None  # inside a dict/any-typed field: free-form keys
        if part not in model.model_fields:
            return f"{model.__name__} has no field {part!r} (path {'.'.join(parts[: depth + 1])})"
        annotation = model.model_fields[part].annotation
        candidates = [a for a in (annotation, *typing.get_args(annotation)) if inspect.isclass(a)]
        model = next((a for a in candidates if issubclass(a, BaseModel)), None)
    return None
