//! The unsharded model equals candle-transformers' `flux::model::Flux` on the same
//! checkpoint and inputs. Build with `--features candle-parity`.
#![cfg(feature = "candle-parity")]

mod common;

use candle_transformers::models::flux::{model, WithForward};
use common::*;
use mold_exec::*;

#[test]
fn matches_candle_transformers_flux() {
    let cfg = FluxConfig::flux_tiny();
    let theirs = model::Config {
        in_channels: cfg.in_channels,
        vec_in_dim: cfg.vec_in_dim,
        context_in_dim: cfg.context_in_dim,
        hidden_size: cfg.hidden,
        mlp_ratio: cfg.mlp_ratio,
        num_heads: cfg.heads,
        depth: cfg.depth,
        depth_single_blocks: cfg.depth_single,
        axes_dim: cfg.axes_dim.to_vec(),
        theta: cfg.theta as usize,
        qkv_bias: true,
        guidance_embed: cfg.guidance_embed,
    };
    for seed in [1u64, 2, 3] {
        let dir = tmpdir("parity");
        let path = write_testdata(&cfg, &dir, seed, DType::F32).unwrap();
        let vb = unsafe {
            candle_nn::VarBuilder::from_mmaped_safetensors(&[&path], DType::F32, &Device::Cpu)
        }
        .unwrap();
        let flux = model::Flux::new(&theirs, vb).unwrap();
        let x = tiny_inputs(seed);
        let expected = flux
            .forward(
                &x.img,
                &x.img_ids,
                &x.txt,
                &x.txt_ids,
                &x.timesteps,
                &x.y,
                x.guidance.as_ref(),
            )
            .unwrap();
        let ckpt = Checkpoint::open(&path).unwrap();
        let ours = Executor::reference(&cfg, &ckpt, &mold_plan::DeviceId::Host, DType::F32)
            .unwrap()
            .forward(&x)
            .unwrap();
        let err = max_relative_error(&ours, &expected).unwrap();
        eprintln!("seed {seed}: unsharded vs candle-transformers {err:e}");
        assert!(err <= 1e-6, "seed {seed}: {err:e}");
        let tp = Executor::new(
            &cfg,
            &plan(vec![part(
                &["emu:0", "emu:1", "emu:2", "emu:3"],
                &["double 0..2", "single 0..3"],
                false,
            )]),
            &ckpt,
        )
        .unwrap()
        .forward(&x)
        .unwrap();
        let err = max_relative_error(&tp, &expected).unwrap();
        eprintln!("seed {seed}: TP 4 vs candle-transformers {err:e}");
        assert!(err <= 1e-5, "seed {seed}, TP 4: {err:e}");
    }
}
