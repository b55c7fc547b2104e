//! Loading a server of several replicas: each text encoder, the VAE and the transformer read
//! from the checkpoint once, every other replica's instance copied device to device from
//! it, and the copies answer as the instances read would.

mod common;

use common::*;
use mold_serve::ServeOptions;

#[test]
fn other_replicas_copy_the_encoders_and_the_vae_and_answer_alike() {
    let (lines, log) = keep_log();
    let o = ServeOptions {
        warm_up: false,
        ..opts()
    };
    let h = Detached(Some(
        mold_serve::spawn_logged(&deployment(2), &o, log).unwrap(),
    ));
    {
        let l = lines.lock().unwrap();
        for c in ["t5", "clip", "vae"] {
            let read = format!("load   {c} on emu:0: ");
            let copied = format!("load   {c} on emu:2 (copied from emu:0): ");
            assert!(l.iter().any(|x| x.starts_with(&read)), "{c}: {l:?}");
            assert!(l.iter().any(|x| x.starts_with(&copied)), "{c}: {l:?}");
            // Read once: no other load of it from the files.
            let reads = l
                .iter()
                .filter(|x| x.starts_with(&format!("load   {c} on ")) && !x.contains("copied"))
                .filter(|x| x.contains(" in "))
                .count();
            assert_eq!(reads, 1, "{c}: {l:?}");
        }
        assert!(!l.iter().any(|x| x.contains("cannot copy")), "{l:?}");
        // Every tensor the copies asked for came from the first load, none from the files.
        assert!(!l.iter().any(|x| x.contains("were not kept")), "{l:?}");
    }
    // Requests at once spread over both devices' encoders and VAEs (the pool): every
    // answer is the image of the request run alone.
    let want = alone(&plan(1), 5, 2);
    let url = format!("http://{}/v1/generate", h.addr());
    let pngs: Vec<Vec<u8>> = std::thread::scope(|s| {
        let ts: Vec<_> = (0..6)
            .map(|_| {
                let url = url.clone();
                s.spawn(move || {
                    let r = client().post(&url).json(&body(5, 2)).send().unwrap();
                    assert_eq!(r.status(), 200);
                    r.bytes().unwrap().to_vec()
                })
            })
            .collect();
        ts.into_iter().map(|t| t.join().unwrap()).collect()
    });
    for png in &pngs {
        assert!(png == &want, "a copied instance answered another image");
    }
    shutdown_within(h.take());
}
