// What the ops share: argument errors (ValueError in Python), dtype checks, the kernels' element
// types, and row-contiguous copies of inputs the CPU kernels cannot read in place.
#pragma once

#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"

#include "kernels/elem_type.h"

namespace mlx_h2o {

namespace mx = mlx::core;

/** "(2, 3)", "(4,)": shapes as Python prints them, for error messages. */
std::string shape_str(const mx::Shape& s);

/** Throws std::invalid_argument (ValueError in Python) with `msg`. */
[[noreturn]] void fail(const std::string& msg);

bool is_float_dtype(mx::Dtype t);

/** float32 / float16 / bfloat16 / bool as the kernels' ElemType. */
ElemType elem_type(mx::Dtype t);

/** True when the last axis (of length > 1) is not unit-stride: the kernels read rows as vectors. */
bool needs_copy(const mx::array& a);

/** A row-contiguous copy of `a`, made inside the stream's queue (the source is only valid once
 *  earlier tasks ran) and kept alive by the encoder. */
mx::array contiguous_copy(const mx::array& a, mx::cpu::CommandEncoder& enc);

/** For kernels that read every input as row-contiguous: copies the inputs that are not (rare),
 *  registers all with the encoder, allocates the outputs; returns the inputs to read. */
std::vector<mx::array> prepare_contiguous(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs,
                                          mx::cpu::CommandEncoder& enc);

}  // namespace mlx_h2o
