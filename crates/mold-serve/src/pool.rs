//! The per-device lock pool: who runs on each device right now, and which encoder and
//! VAE instances each device holds, within its memory budget.
//!
//! Every device has one lock. A replica's transformer takes the locks of all its devices
//! for a request's denoising ([`Pool::transformer`]); a text encoder or the VAE takes the
//! lock of one device for one encode or decode ([`Pool::component`]). So a component
//! never runs on a device whose transformer is mid-request, and a transformer never
//! starts on a device where a component runs.
//!
//! - **No deadlock**: a transformer takes its locks one at a time in the pool's fixed
//!   device order (sorted ids) and a component takes a single lock, never waiting while
//!   it holds one: no cycle of waits can form.
//! - **Memory**: a device starts with what the plans place there (weights, stream buffers,
//!   their largest activation: [`DeviceBudget`]). A component runs where the plan put an
//!   instance of it, where the pool already loaded one, or where a new one fits: weights
//!   added and the largest activation raised, the total within the budget less headroom.
//!   Instances stay loaded (loaded once, reused).
//! - **Release**: locks are RAII guards ([`ComponentLease`], [`TransformerLease`]),
//!   released on every path, errors and cancellation included; a lease whose new
//!   instance failed to load gives its reservation back ([`ComponentLease::load_failed`]).

use mold_plan::DeviceId;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// One device as the pool sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceBudget {
    pub id: DeviceId,
    /// Bytes the pool may account on it: the budget less the headroom.
    pub capacity: u64,
    /// Held by what the plans place here: weights and stream buffers.
    pub held: u64,
    /// The largest activation of what the plans run here.
    pub activation: u64,
    /// Whether instances the plans did not place may be loaded here (not on the host).
    pub extra: bool,
}

/// An encoder or the VAE as the pool sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ComponentCost {
    pub name: String,
    pub weight: u64,
    pub activation: u64,
    /// Devices where a plan placed an instance (accounted in their `held`).
    pub planned: Vec<DeviceId>,
}

/// What holds a device's lock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Holder {
    /// A replica's transformer, for a request.
    Transformer { replica: usize, request: u64 },
    /// An encoder or the VAE (index into the pool's components), for a request.
    Component { component: usize, request: u64 },
}

/// The request waited for a device and was cancelled meanwhile.
#[derive(Debug, PartialEq, Eq)]
pub struct Cancelled;

struct State {
    holder: Vec<Option<Holder>>,
    /// Per device, the components loaded beyond the plans.
    extra: Vec<Vec<usize>>,
}

/// The lock pool of a server's devices.
pub struct Pool {
    devices: Vec<DeviceBudget>,
    components: Vec<ComponentCost>,
    state: Mutex<State>,
    freed: Condvar,
}

/// How long a waiting component sleeps before looking at its cancel flag again.
const CANCEL_POLL: Duration = Duration::from_millis(20);

impl Pool {
    /// A pool over `devices` (put in id order: the order locks are taken in).
    pub fn new(mut devices: Vec<DeviceBudget>, components: Vec<ComponentCost>) -> Pool {
        devices.sort_by(|a, b| a.id.cmp(&b.id));
        let n = devices.len();
        Pool {
            devices,
            components,
            state: Mutex::new(State {
                holder: vec![None; n],
                extra: vec![Vec::new(); n],
            }),
            freed: Condvar::new(),
        }
    }

    pub fn devices(&self) -> &[DeviceBudget] {
        &self.devices
    }

    pub fn components(&self) -> &[ComponentCost] {
        &self.components
    }

    /// The index of a device, if the pool has it.
    pub fn index(&self, id: &DeviceId) -> Option<usize> {
        self.devices.iter().position(|d| &d.id == id)
    }

    /// The index of a component by name.
    pub fn component_index(&self, name: &str) -> Option<usize> {
        self.components.iter().position(|c| c.name == name)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the state lock leaves it consistent (every change is a
        // single assignment): carry on with it.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Accounted bytes of device `d` given its extra instances `extra`.
    fn used_with(&self, d: usize, extra: &[usize]) -> u64 {
        let dev = &self.devices[d];
        let weights: u64 = extra.iter().map(|&c| self.components[c].weight).sum();
        let act = extra
            .iter()
            .map(|&c| self.components[c].activation)
            .max()
            .unwrap_or(0)
            .max(dev.activation);
        dev.held.saturating_add(weights).saturating_add(act)
    }

    /// Accounted bytes of every device now (id order).
    pub fn used(&self) -> Vec<u64> {
        let s = self.lock();
        (0..self.devices.len())
            .map(|d| self.used_with(d, &s.extra[d]))
            .collect()
    }

    /// What holds each device now (id order).
    pub fn holders(&self) -> Vec<Option<Holder>> {
        self.lock().holder.clone()
    }

    /// The components loaded beyond the plans, per device (id order).
    pub fn extras(&self) -> Vec<Vec<usize>> {
        self.lock().extra.clone()
    }

    /// Whether component `c` has an instance on device `d` (planned or loaded).
    fn present(&self, s: &State, c: usize, d: usize) -> bool {
        self.components[c].planned.contains(&self.devices[d].id) || s.extra[d].contains(&c)
    }

    /// The device component `c` should run on now among `allowed` (all devices when
    /// `None`), and whether a new instance must be loaded there: a free device that has
    /// one, else the free device where a new one fits with the most room left.
    fn choose(&self, s: &State, c: usize, allowed: Option<&[usize]>) -> Option<(usize, bool)> {
        let candidates: Vec<usize> = match allowed {
            Some(a) => a.to_vec(),
            None => (0..self.devices.len()).collect(),
        };
        let free: Vec<usize> = candidates
            .into_iter()
            .filter(|&d| d < self.devices.len() && s.holder[d].is_none())
            .collect();
        if let Some(&d) = free.iter().find(|&&d| self.present(s, c, d)) {
            return Some((d, false));
        }
        free.iter()
            .filter(|&&d| self.devices[d].extra)
            .filter_map(|&d| {
                let mut with = s.extra[d].clone();
                with.push(c);
                let used = self.used_with(d, &with);
                (used <= self.devices[d].capacity).then(|| (self.devices[d].capacity - used, d))
            })
            .max_by_key(|&(room, d)| (room, std::cmp::Reverse(d)))
            .map(|(_, d)| (d, true))
    }

    /// Takes a device for component `c` among `allowed` (all devices when `None`) for
    /// `request`, waiting until one is free (and has, or has room for, an instance);
    /// gives up once `cancel` is set. `allowed` must include a device the plans put an
    /// instance on (that one always qualifies once free), or the wait may never end.
    pub fn component(
        &self,
        c: usize,
        allowed: Option<&[usize]>,
        request: u64,
        cancel: &AtomicBool,
    ) -> Result<ComponentLease<'_>, Cancelled> {
        let mut s = self.lock();
        loop {
            if cancel.load(Ordering::Relaxed) {
                return Err(Cancelled);
            }
            if let Some((d, load)) = self.choose(&s, c, allowed) {
                s.holder[d] = Some(Holder::Component {
                    component: c,
                    request,
                });
                if load {
                    s.extra[d].push(c);
                }
                return Ok(ComponentLease {
                    pool: self,
                    device: d,
                    component: c,
                    load,
                });
            }
            s = self
                .freed
                .wait_timeout(s, CANCEL_POLL)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Takes the locks of `devices` (indices) for replica `replica`'s transformer, one at
    /// a time in the pool's order, each as soon as it is free.
    pub fn transformer(
        &self,
        replica: usize,
        devices: &[usize],
        request: u64,
    ) -> TransformerLease<'_> {
        let mut order: Vec<usize> = devices.to_vec();
        order.sort_unstable();
        order.dedup();
        let mut s = self.lock();
        for &d in &order {
            while s.holder[d].is_some() {
                s = self.freed.wait(s).unwrap_or_else(|e| e.into_inner());
            }
            s.holder[d] = Some(Holder::Transformer { replica, request });
        }
        TransformerLease {
            pool: self,
            devices: order,
        }
    }

    fn release(&self, devices: &[usize]) {
        let mut s = self.lock();
        for &d in devices {
            s.holder[d] = None;
        }
        drop(s);
        self.freed.notify_all();
    }
}

/// A device held for one encode or decode; released when dropped.
pub struct ComponentLease<'a> {
    pool: &'a Pool,
    device: usize,
    component: usize,
    load: bool,
}

impl ComponentLease<'_> {
    pub fn device(&self) -> usize {
        self.device
    }
    pub fn device_id(&self) -> &DeviceId {
        &self.pool.devices[self.device].id
    }
    /// Whether the component has no instance on this device yet (the holder loads it).
    pub fn must_load(&self) -> bool {
        self.load
    }
    /// The new instance could not be loaded: its memory is given back.
    pub fn load_failed(self) {
        if self.load {
            let mut s = self.pool.lock();
            s.extra[self.device].retain(|&c| c != self.component);
        }
    }
}

impl Drop for ComponentLease<'_> {
    fn drop(&mut self) {
        self.pool.release(&[self.device]);
    }
}

/// A transformer's devices, held for one request; released when dropped.
pub struct TransformerLease<'a> {
    pool: &'a Pool,
    devices: Vec<usize>,
}

impl Drop for TransformerLease<'_> {
    fn drop(&mut self) {
        self.pool.release(&self.devices);
    }
}

#[cfg(test)]
mod tests;
