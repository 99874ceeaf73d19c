#pragma once
// FP8 checkpoints with block scales (DeepSeek-V3 §3.3.2 "fine-grained quantization", the layout
// of GLM-5.3-Flash's published weights and transformers' FineGrainedFP8 integration): a weight
// [R, C] is stored as float8_e4m3fn with one fp32 scale per block of br x bc entries,
// `weight_scale_inv` [ceil(R/br), ceil(C/bc)]; the weight is fp8 * its block's scale. Blocks at
// the bottom and right edges are cropped when R or C is not a multiple of the block.
#include <torch/torch.h>

namespace kiln::model {

/// Dequantises `w` [R, C] float8_e4m3fn with `scale_inv` [ceil(R/block_rows),
/// ceil(C/block_cols)] (any float dtype, used in fp32) to `out` dtype: out[r, c] =
/// float(w[r, c]) * scale_inv[r / block_rows, c / block_cols], rounded once. Throws
/// std::invalid_argument naming the shapes and dtypes when w is not 2-D float8_e4m3fn or the
/// scale grid does not fit w and the block.
torch::Tensor dequantize_fp8_blocks(const torch::Tensor& w, const torch::Tensor& scale_inv, int64_t block_rows,
                                    int64_t block_cols, torch::Dtype out = torch::kBFloat16);

}  // namespace kiln::model
