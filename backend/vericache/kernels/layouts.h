// The numbers the Python side hands the packed op by position: one definition here, and one in
// kernels/layouts.py (the Python names), which checks that the two agree before any build of the kernels.
//
// A part of a sequence's cache (kv/packed.py's KeyPart) crosses into C++ as PART_INTS ints and
// PART_TENSORS optional tensors, in the orders below; a step's parts one after another.
#pragma once

namespace vc_layout {

// How a part's K or V rows are stored (layouts.py's store kinds; quant_format.h's layouts)
enum StoreKind { TOKEN_GROUPS = 0, CHANNEL_GROUPS = 1, FP8 = 2, DENSE = 3 };

// a part's ints: its sequence, its keys per KV head, its causal diagonal (-1: seen whole), then for K and
// for V: the store kind, bits a code and group size; last whether its scores are exact (1: the model's
// numerics, integer dots under q8qk; 0: a drafter's part, fp32 scores whatever the numerics)
enum PartInt { SEQ = 0, N_KEYS = 1, DIAG = 2, K_KIND = 3, K_BITS = 4, K_GROUP = 5, V_KIND = 6, V_BITS = 7,
               V_GROUP = 8, EXACT = 9, PART_INTS = 10 };

// a part's tensors: K (dense rows or codes) with its scale and zero, V alike, the positions of KIVI's
// channel groups, the optional attention-seen output, and a dense part's optional q8qk codes of its keys
// and values (int_scores.h's layouts, kept by the cache: key codes, scales and code sums, value codes and
// scales, and how many keys hold them: an int64 the op reads and advances)
enum PartTensor { K_ROWS = 0, K_SCALE = 1, K_ZERO = 2, V_ROWS = 3, V_SCALE = 4, V_ZERO = 5, POS = 6, SEEN = 7,
                  K_CODES = 8, K_DK = 9, K_CSUM = 10, V_CODES = 11, V_DV = 12, K_CODED = 13, PART_TENSORS = 14 };

}  // namespace vc_layout
