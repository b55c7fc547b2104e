use super::*;
use proptest::prelude::*;
use std::sync::atomic::AtomicU8;
use std::sync::mpsc;
use std::sync::Arc;

const FREE: u8 = 0;
const TRANSFORMER: u8 = 1;
const COMPONENT: u8 = 2;

fn emu(i: u32) -> DeviceId {
    DeviceId::Emu(i)
}

/// What one client does: a component run (component, allowed devices or all) or a
/// replica's transformer run.
#[derive(Clone, Debug)]
enum Op {
    Component(usize, Option<Vec<usize>>),
    Transformer(usize),
}

#[derive(Clone, Debug)]
struct Case {
    devices: Vec<DeviceBudget>,
    components: Vec<ComponentCost>,
    /// Each replica's transformer devices (indices, disjoint).
    replicas: Vec<Vec<usize>>,
    /// One script per client thread.
    clients: Vec<Vec<Op>>,
}

fn case() -> impl Strategy<Value = Case> {
    (2usize..6, 1usize..4).prop_flat_map(|(n, ncomp)| {
        let devices = proptest::collection::vec((0u64..40, 0u64..20, 0u64..60), n);
        let comps = proptest::collection::vec((1u64..30, 0u64..20, 0..n), ncomp);
        let split = 1usize..=n;
        (devices, comps, split, Just(n), Just(ncomp))
            .prop_flat_map(|(devs, comps, split, n, ncomp)| {
                // Replicas: consecutive runs of the first `split` devices, 1 or 2 wide.
                let mut replicas = Vec::new();
                let mut i = 0;
                while i < split {
                    let w = if i + 1 < split && i % 3 == 0 { 2 } else { 1 };
                    replicas.push((i..i + w).collect::<Vec<_>>());
                    i += w;
                }
                let nrep = replicas.len();
                let op = prop_oneof![
                    (
                        0..ncomp,
                        proptest::option::of(proptest::collection::vec(0..n, 1..3))
                    )
                        .prop_map(|(c, a)| Op::Component(c, a)),
                    (0..nrep).prop_map(Op::Transformer),
                ];
                let clients = proptest::collection::vec(proptest::collection::vec(op, 1..12), 1..6);
                let devices: Vec<DeviceBudget> = devs
                    .iter()
                    .enumerate()
                    .map(|(i, &(held, act, spare))| DeviceBudget {
                        id: emu(i as u32),
                        capacity: held + act + spare,
                        held,
                        activation: act,
                        extra: true,
                    })
                    .collect();
                let components: Vec<ComponentCost> = comps
                    .iter()
                    .enumerate()
                    .map(|(i, &(w, a, planned))| ComponentCost {
                        name: format!("c{i}"),
                        weight: w,
                        activation: a,
                        planned: vec![emu(planned as u32)],
                    })
                    .collect();
                (Just(devices), Just(components), Just(replicas), clients)
            })
            .prop_map(|(devices, components, replicas, clients)| Case {
                devices,
                components,
                replicas,
                clients,
            })
    })
}

/// Runs every client on a thread of its own against one pool, checking at each grant
/// that no transformer and component share a device and that no device is over its
/// budget; returns when all are done, or fails if they are not within a minute (a
/// deadlock: every operation here takes microseconds).
fn run(case: &Case) -> Result<(), String> {
    // The planned instances must fit, as the planner guarantees for real plans.
    let pool = Arc::new(Pool::new(case.devices.clone(), case.components.clone()));
    let busy: Arc<Vec<AtomicU8>> = Arc::new(
        (0..case.devices.len())
            .map(|_| AtomicU8::new(FREE))
            .collect(),
    );
    let (tx, rx) = mpsc::channel::<Result<(), String>>();
    for (k, script) in case.clients.iter().enumerate() {
        let (pool, busy, tx) = (pool.clone(), busy.clone(), tx.clone());
        let script = script.clone();
        let replicas = case.replicas.clone();
        std::thread::spawn(move || {
            let never = AtomicBool::new(false);
            let check_budget = |pool: &Pool| -> Result<(), String> {
                for (d, used) in pool.used().iter().enumerate() {
                    let cap = pool.devices()[d].capacity;
                    if *used > cap {
                        return Err(format!("device {d}: {used} bytes accounted > {cap}"));
                    }
                }
                Ok(())
            };
            let mut out = Ok(());
            for (i, op) in script.iter().enumerate() {
                let request = (k * 100 + i) as u64;
                match op {
                    Op::Component(c, allowed) => {
                        // As the server asks: anywhere, or among devices that include one
                        // the plan put an instance on.
                        let allowed = allowed.clone().map(|mut a| {
                            let planned = &pool.components()[*c].planned[0];
                            a.push(pool.index(planned).unwrap());
                            a
                        });
                        let lease = pool
                            .component(*c, allowed.as_deref(), request, &never)
                            .unwrap();
                        let d = lease.device();
                        if let Some(a) = allowed {
                            if !a.contains(&d) {
                                out = Err(format!("component on device {d}, outside {a:?}"));
                            }
                        }
                        let was = busy[d].swap(COMPONENT, Ordering::SeqCst);
                        if was != FREE {
                            out = Err(format!(
                                "component {c} granted device {d} while it runs {was}"
                            ));
                        }
                        if let Err(e) = check_budget(&pool) {
                            out = Err(e);
                        }
                        std::thread::yield_now();
                        busy[d].store(FREE, Ordering::SeqCst);
                        // Some loads fail: their reservation goes back.
                        if lease.must_load() && request.is_multiple_of(3) {
                            lease.load_failed();
                        }
                    }
                    Op::Transformer(r) => {
                        let lease = pool.transformer(*r, &replicas[*r], request);
                        for &d in &replicas[*r] {
                            let was = busy[d].swap(TRANSFORMER, Ordering::SeqCst);
                            if was != FREE {
                                out = Err(format!(
                                    "replica {r} granted device {d} while it runs {was}"
                                ));
                            }
                        }
                        std::thread::yield_now();
                        for &d in &replicas[*r] {
                            busy[d].store(FREE, Ordering::SeqCst);
                        }
                        drop(lease);
                    }
                }
                if out.is_err() {
                    break;
                }
            }
            let _ = tx.send(out);
        });
    }
    drop(tx);
    for _ in 0..case.clients.len() {
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(r) => r?,
            Err(_) => return Err("clients did not finish: deadlock".into()),
        }
    }
    if pool.holders().iter().any(Option::is_some) {
        return Err(format!("locks left held: {:?}", pool.holders()));
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Random arrivals: no deadlock, a component never on a device whose transformer
    /// runs (nor the reverse), memory never over budget, every lock released.
    #[test]
    fn random_arrivals(case in case()) {
        // The plans' own instances fit on their devices (the planner's guarantee).
        let mut case = case;
        for d in &mut case.devices {
            d.capacity = d.capacity.max(d.held + d.activation);
        }
        prop_assert_eq!(run(&case), Ok(()));
    }
}

fn budget(i: u32, capacity: u64, held: u64) -> DeviceBudget {
    DeviceBudget {
        id: emu(i),
        capacity,
        held,
        activation: 0,
        extra: true,
    }
}

fn cost(name: &str, weight: u64, planned: u32) -> ComponentCost {
    ComponentCost {
        name: name.into(),
        weight,
        activation: 1,
        planned: vec![emu(planned)],
    }
}

#[test]
fn a_component_goes_where_it_is_loaded_then_where_it_fits() {
    // emu:0 has the planned t5; emu:1 has room for another; emu:2 has none.
    let pool = Pool::new(
        vec![budget(0, 100, 50), budget(1, 100, 50), budget(2, 100, 95)],
        vec![cost("t5", 20, 0)],
    );
    let never = AtomicBool::new(false);
    let a = pool.component(0, None, 1, &never).unwrap();
    assert_eq!((a.device(), a.must_load()), (0, false));
    // emu:0 is busy: a second instance loads on emu:1 (emu:2 has no room).
    let b = pool.component(0, None, 2, &never).unwrap();
    assert_eq!((b.device(), b.must_load()), (1, true));
    assert_eq!(pool.used(), vec![50, 50 + 20 + 1, 95]);
    drop((a, b));
    // Loaded once: both instances are reused.
    let t = pool.transformer(0, &[0], 3);
    let c = pool.component(0, None, 4, &never).unwrap();
    assert_eq!((c.device(), c.must_load()), (1, false));
    assert_eq!(pool.extras(), vec![vec![], vec![0], vec![]]);
    drop((t, c));
}

#[test]
fn a_component_never_runs_on_a_busy_transformer_device_and_cancel_stops_its_wait() {
    let pool = Pool::new(vec![budget(0, 100, 50)], vec![cost("vae", 10, 0)]);
    let t = pool.transformer(0, &[0], 1);
    let cancel = AtomicBool::new(true);
    assert!(pool.component(0, None, 2, &cancel).is_err());
    assert_eq!(
        pool.holders(),
        vec![Some(Holder::Transformer {
            replica: 0,
            request: 1
        })]
    );
    drop(t);
    let never = AtomicBool::new(false);
    let c = pool.component(0, None, 3, &never).unwrap();
    assert_eq!(c.device(), 0);
}

#[test]
fn a_failed_load_gives_its_memory_back() {
    let pool = Pool::new(
        vec![budget(0, 100, 0), budget(1, 100, 0)],
        vec![cost("t5", 60, 0)],
    );
    let never = AtomicBool::new(false);
    let a = pool.component(0, None, 1, &never).unwrap();
    let b = pool.component(0, None, 2, &never).unwrap();
    assert!(b.must_load());
    b.load_failed();
    assert_eq!(pool.extras(), vec![Vec::<usize>::new(), vec![]]);
    assert_eq!(pool.used(), vec![0, 0]);
    drop(a);
    assert!(pool.holders().iter().all(Option::is_none));
}
