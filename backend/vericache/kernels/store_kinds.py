"""The kinds of stored key/value rows the attention kernels read: one definition for the Python side
(``kv.quantized``'s layouts, ``kv.packed``'s op arguments, the Triton twin). The native op's C++ reads the
same numbers (``packed_attention.cpp``'s ``DENSE``; ``quant_format.h``'s ``kind`` tests); a test holds the
two sides together."""

TOKEN_GROUPS = 0     # per token, min/max over groups of channels (INT4/INT8; KIVI's values)
CHANNEL_GROUPS = 1   # per channel, min/max over groups of positions (KIVI's keys)
FP8 = 2              # e4m3 codes, one fp16 scale per token row
DENSE = 3            # dense rows (fp32, fp16, bf16): a full cache, a compressed cache's residual
