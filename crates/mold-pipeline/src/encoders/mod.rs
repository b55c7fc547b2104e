//! Text encoders shared by families, on mold's layers (mold-exec's products and kernels):
//! [`t5`] (FLUX, SD3.5, LTX-Video) and [`clip`] (FLUX, SD3.5). A family's `text.rs` adds its
//! tokenizer and what it takes from the output (FLUX: T5's sequence, CLIP's pooled vector).

pub mod clip;
pub mod t5;
