"""The sandbox's child process: isolate, limit, install the audit hook, then run the code from stdin.

Run by `sandbox.run_python` as `python -I -S -u -X utf8 sandbox_boot.py CONFIG_JSON` with the working
directory as cwd, an empty environment, stdin holding the code and fd `CONFIG_JSON["status_fd"]` a
pipe on which it reports (one JSON line) which isolation layers it applied. Standard library only; no
import of the project (this file runs without the project on sys.path). See sandbox.py for what each
layer enforces.
"""

import json
import os
import sys

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000
SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 0x1
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

# Refused whatever their arguments: processes, signals to others, network, native code, limits.
BLOCKED_EVENTS = frozenset(
    [
        "os.system",
        "os.exec",
        "os.spawn",
        "os.posix_spawn",
        "os.fork",
        "os.forkpty",
        "subprocess.Popen",
        "pty.spawn",
        "os.kill",
        "os.killpg",
        "signal.pthread_kill",
        "socket.__new__",
        "socket.connect",
        "socket.bind",
        "socket.sendto",
        "socket.sendmsg",
        "socket.getaddrinfo",
        "socket.gethostbyname",
        "resource.setrlimit",
        "resource.prlimit",
        "sys.addaudithook",
        "os.link",
        "os.symlink",
        "os.chdir",
        "gc.get_objects",
        "gc.get_referrers",
        "gc.get_referents",
        "cpython.run_interactivehook",
    ]
)
BLOCKED_IMPORTS = [
    "ctypes",
    "_ctypes",
    "_posixsubprocess",
    "_xxsubinterpreters",
    "_xxinterpchannels",
    "_testcapi",
    "_testinternalcapi",
    "_testbuffer",
    "_testmultiphase",
    "_testimportmultiple",
    "_testsinglephase",
    "_xxtestfuzz",
]
# Events that change the file system: (indexes of path arguments, indexes of dir_fd arguments).
PATH_EVENTS = {
    "os.remove": ((0,), (1,)),
    "os.rmdir": ((0,), (1,)),
    "os.mkdir": ((0,), (2,)),
    "os.rename": ((0, 1), (2, 3)),
    "os.chmod": ((0,), (2,)),
    "os.chown": ((0,), (3,)),
    "os.utime": ((0,), (3,)),
    "os.truncate": ((0,), ()),
    "os.chflags": ((0,), ()),
    "os.setxattr": ((0,), ()),
    "os.removexattr": ((0,), ()),
}


def isolate(work: str) -> list[str]:
    """New user+mount+network namespaces where the kernel allows: no network, a read-only file system
    except `work`. Returns the layers applied. Uses ctypes, so it runs before the audit hook."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for flags in (
        CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET,
        CLONE_NEWNS | CLONE_NEWNET,
        CLONE_NEWUSER | CLONE_NEWNET,
        CLONE_NEWNET,
    ):
        if libc.unshare(flags) == 0:
            break
    else:
        return []
    applied = ["network-namespace"]
    if flags & CLONE_NEWNS and libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) == 0:

        class MountAttr(ctypes.Structure):
            _fields_ = [(n, ctypes.c_uint64) for n in ("attr_set", "attr_clr", "propagation", "userns_fd")]

        def setattr_(path: bytes, recursive: bool, **values: int) -> bool:
            attr = MountAttr(**values)
            where = AT_RECURSIVE if recursive else 0
            return libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path, where, ctypes.byref(attr), 32) == 0

        target = work.encode()
        if (
            setattr_(b"/", True, attr_set=MOUNT_ATTR_RDONLY)
            and libc.mount(target, target, None, MS_BIND, None) == 0
            and setattr_(target, False, attr_clr=MOUNT_ATTR_RDONLY)
        ):
            os.chdir(work)  # onto the writable bind mount (the old cwd is the read-only one under it)
            applied.append("read-only-mounts")
    for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[name]  # a later `import ctypes` goes through the audit hook (and is refused)
    return applied


def set_limits(config: dict) -> None:
    import resource

    cpu = int(config["cpu_seconds"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at the soft limit, SIGKILL 1 s later
    for limit, value in (
        (resource.RLIMIT_AS, config["memory_bytes"]),
        (resource.RLIMIT_FSIZE, config["file_size_bytes"]),
        (resource.RLIMIT_NPROC, config["max_processes"]),
        (resource.RLIMIT_NOFILE, config["max_open_files"]),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(limit, (int(value), int(value)))


def install_audit_hook(work: str) -> None:
    """Refuse BLOCKED_EVENTS, BLOCKED_IMPORTS, ctypes, and file-system changes outside `work`.

    The hook reads only its closure (frozen copies of the tables and of the builtins it calls), never
    module globals or builtins at call time: code that reaches this module's globals (through
    `sys._getframe(1).f_globals`) or patches `builtins` changes nothing. Paths are checked as text
    (normalised with str methods, so patching os or posixpath cannot fool it) against `work`, which
    holds no links (os.link and os.symlink are refused) and cannot be left (os.chdir is refused).
    Writes need a str, bytes or fd path: a path-like object could answer the check and the open
    differently.
    """
    blocked_events, blocked_imports = frozenset(BLOCKED_EVENTS), frozenset(BLOCKED_IMPORTS)
    path_events = {event: (tuple(p), tuple(d)) for event, (p, d) in PATH_EVENTS.items()}.get
    write_flags, prefix = int(WRITE_FLAGS), work + "/"
    type_, len_, str_, bytes_, int_, list_ = type, len, str, bytes, int, list
    denied, import_denied = PermissionError, ImportError

    def normalise(path: str) -> str:
        if not path.startswith("/"):
            path = prefix + path
        parts = list_()
        for part in path.split("/"):
            if part == "..":
                if parts:
                    parts.pop()
            elif part and part != ".":
                parts.append(part)
        return "/" + "/".join(parts)

    def text_of(path: object) -> str:
        if type_(path) is bytes_:
            return path.decode("utf-8", "surrogateescape")
        if type_(path) is str_:
            return path
        raise denied("sandbox: pass file paths as str to change files")

    def inside(path: object) -> bool:
        if type_(path) is int_:
            return True  # an open descriptor: its opening was checked
        resolved = normalise(text_of(path))
        return resolved == work or resolved.startswith(prefix)

    def hook(event: str, args: tuple) -> None:
        if event in blocked_events or event.startswith("ctypes."):
            raise denied(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode, flags = args
            writes = type_(flags) is int_ and flags & write_flags
            if type_(mode) is str_:
                writes = writes or "w" in mode or "a" in mode or "x" in mode or "+" in mode
            if not writes:
                return
            if mode is None and type_(path) is not int_ and not text_of(path).startswith("/"):
                raise denied("sandbox: os.open for writing needs an absolute path (dir_fd is not checked)")
            if not inside(path):
                raise denied(f"sandbox: writing is not allowed outside the working directory {work}")
            return
        checks = path_events(event)
        if checks is not None:
            for i in checks[1]:
                if i < len_(args) and args[i] is not None:
                    raise denied(f"sandbox: {event} with dir_fd is not allowed")
            for i in checks[0]:
                if i < len_(args) and not inside(args[i]):
                    raise denied(f"sandbox: {event} is not allowed outside the working directory {work}")
        elif event == "import" and type_(args[0]) is str_ and args[0].split(".")[0] in blocked_imports:
            raise import_denied(f"sandbox: importing {args[0]} is not allowed")

    sys.addaudithook(hook)


def main() -> None:
    config = json.loads(sys.argv[1])
    work = config["work"]
    code = sys.stdin.read()
    layers = isolate(work) if config["isolate"] else []
    os.environ.clear()  # the parent passes none; this drops the LC_CTYPE of Python's locale coercion
    set_limits(config)
    layers.append("rlimits")
    import builtins
    import linecache
    import traceback
    import types

    if config["audit_hook"]:
        install_audit_hook(work)
        layers.append("audit-hook")
    status_fd = config["status_fd"]
    os.write(status_fd, (json.dumps({"layers": layers}) + "\n").encode())
    os.close(status_fd)
    linecache.cache["<sandbox>"] = (len(code), None, code.splitlines(True), "<sandbox>")
    module = types.ModuleType("__main__")
    module.__builtins__ = builtins
    module.exit = module.quit = sys.exit  # no site module: give the code the usual exit()
    sys.modules["__main__"] = module
    try:
        exec(compile(code, "<sandbox>", "exec"), module.__dict__)
    except SystemExit:
        raise
    except BaseException as e:
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
        traceback.print_exception(type(e), e, tb)
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
