"""The model's tokenizer and chat template (loom_encoder): samples to ids
exactly as `loom train` tokenizes JSONL."""
import ctypes as C

import numpy as np

from . import _lib as L
from .batch import IGNORE, dumps
from .errors import InvalidArgumentError


class Encoder:
    def __init__(self, ctx, directory):
        self._ctx = ctx
        h = C.c_void_p()
        ctx.check(L.lib.loom_encoder_create(ctx.h, directory.encode(), C.byref(h)),
                  "set_template")
        self.h = h
        self.directory = directory
        self.vocab_size = L.lib.loom_encoder_vocab_size(h)
        self.eos_id = L.lib.loom_encoder_eos_id(h)

    def encode(self, sample, append_eos=True, where="sample", tools=None):
        """(ids, labels) of a text / messages / prompt-completion sample.

        tools: transformers' apply_chat_template(tools=...), a list of tool
        JSON schemas (dicts) for the chat template; the same as the sample's
        own "tools" key (a list, or the list JSON-encoded in a string), which
        it may not also have."""
        if tools is not None:
            if not isinstance(sample, dict):
                raise InvalidArgumentError("%s: tools= goes with a dict sample, not %s"
                                           % (where, type(sample).__name__))
            if sample.get("tools") is not None:
                raise InvalidArgumentError("%s has \"tools\" and tools= was given too: give "
                                           "one of them" % where)
            sample = dict(sample, tools=tools)
        text = dumps(sample).encode()
        ids = C.POINTER(C.c_int32)()
        mask = C.POINTER(C.c_uint8)()
        n = C.c_int64()
        self._ctx.check(L.lib.loom_encoder_encode(self._ctx.h, self.h, text, len(text),
                                                  int(bool(append_eos)), C.byref(ids),
                                                  C.byref(mask), C.byref(n)), where)
        try:
            a = np.ctypeslib.as_array(ids, (n.value,)).astype(np.int64) if n.value else \
                np.zeros(0, np.int64)
            m = np.ctypeslib.as_array(mask, (n.value,)).copy() if n.value else \
                np.zeros(0, np.uint8)
        finally:
            L.lib.loom_free(ids)
            L.lib.loom_free(mask)
        return a, np.where(m == 1, a, IGNORE)

    def decode(self, ids):
        a = np.ascontiguousarray(np.asarray(ids, dtype=np.int32))
        out = C.c_void_p()
        self._ctx.check(L.lib.loom_encoder_decode(self._ctx.h, self.h, L.i32_ptr(a), a.size,
                                                  C.byref(out)), "decode")
        try:
            return C.string_at(out).decode("utf-8", errors="replace")
        finally:
            L.lib.loom_free(out)

    def close(self):
        if getattr(self, "h", None):
            L.lib.loom_encoder_free(self.h)
            self.h = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
