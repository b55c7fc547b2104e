mod common;
use common::*;
use mold_exec::*;
#[test]
fn dbg() {
    let cfg = FluxConfig::flux_tiny();
    let dir = tmpdir("bf16dbg");
    let path = write_testdata(&cfg, &dir, 9, DType::BF16).unwrap();
    let ckpt = Checkpoint::open(&path).unwrap();
    let x = tiny_inputs(9);
    let r32 = Executor::reference(&cfg, &ckpt, &mold_plan::DeviceId::Host, DType::F32)
        .unwrap()
        .forward_inputs(&x)
        .unwrap();
    let r16 = Executor::reference(&cfg, &ckpt, &mold_plan::DeviceId::Host, DType::BF16)
        .unwrap()
        .forward_inputs(&x)
        .unwrap();
    let rf16 = Executor::reference(&cfg, &ckpt, &mold_plan::DeviceId::Host, DType::F16)
        .unwrap()
        .forward_inputs(&x)
        .unwrap();
    println!(
        "bf16 {} f16 {}",
        max_relative_error(&r16, &r32).unwrap(),
        max_relative_error(&rf16, &r32).unwrap()
    );
    println!("{}", r32.abs().unwrap().max_keepdim(2).unwrap());
    let p = plan(vec![part(
        &["emu:0", "emu:1"],
        &["double 0..2", "single 0..3"],
        false,
    )]);
    for seed in [1u64, 2, 3] {
        let c = tiny_checkpoint(seed);
        let x = tiny_inputs(seed);
        let r = Executor::reference(&cfg, &c, &mold_plan::DeviceId::Host, DType::F32)
            .unwrap()
            .forward_inputs(&x)
            .unwrap();
        let o = Executor::new(&cfg, &p, &c)
            .unwrap()
            .forward_inputs(&x)
            .unwrap();
        println!("tp2 f32 err {:e}", max_relative_error(&o, &r).unwrap());
    }
}
