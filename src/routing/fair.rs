//! Who goes next when a pool is saturated: the order of its admission queue. A
//! higher priority class always goes first; within a class, tenants share by virtual
//! token counters (VTC, Sheng et al., OSDI '24): each tenant's counter grows by the
//! tokens of the requests it is admitted (prompt estimate plus `max_tokens`, divided
//! by its weight), the waiter whose tenant has the lowest counter goes next, and a
//! tenant that starts waiting is lifted to the lowest counter of the tenants already
//! waiting, so idle time banks no credit. One tenant's flood cannot starve another's
//! trickle, and within a tenant requests go in arrival order.
//!
//! Each waiter has its own wake-up; a freed slot wakes the one that goes next. Pure
//! but for the wake-ups.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::Notify;

/// Who a waiting request is, for the queue's order.
#[derive(Debug, Clone)]
pub struct Waiting {
    pub tenant: Arc<str>,
    /// Priority class (0 is the highest).
    pub class: usize,
    /// The tenant's share of its class.
    pub weight: f64,
    /// Tokens it is charged when admitted.
    pub cost: f64,
}

#[derive(Debug)]
struct Waiter {
    id: u64,
    who: Waiting,
    wake: Arc<Notify>,
    /// Woken for a freed slot and not yet admitted or passed on.
    woken: bool,
    /// It passed a wake-up on since the last slot freed: it is not woken again for
    /// that one (so a slot nobody may take is offered to each waiter once, not
    /// bounced between two of them).
    passed: bool,
}

/// The waiters of one pool and the tenants' counters.
#[derive(Debug, Default)]
pub struct FairQueue {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    waiters: Vec<Waiter>,
    next_id: u64,
    /// Virtual tokens served per (class, tenant).
    counters: HashMap<(usize, Arc<str>), f64>,
}

/// Tenants' counters are forgotten once this many are kept (those not waiting).
const MAX_COUNTERS: usize = 4096;

impl Inner {
    fn counter(&self, class: usize, tenant: &Arc<str>) -> f64 {
        self.counters
            .get(&(class, tenant.clone()))
            .copied()
            .unwrap_or(0.0)
    }

    /// Where a waiter stands: its class, its tenant's counter, its arrival.
    fn order(&self, w: &Waiter) -> (usize, f64, u64) {
        (w.who.class, self.counter(w.who.class, &w.who.tenant), w.id)
    }

    /// The lowest counter of the tenants waiting in `class`, if any wait.
    fn floor(&self, class: usize) -> Option<f64> {
        self.waiters
            .iter()
            .filter(|w| w.who.class == class)
            .map(|w| self.counter(class, &w.who.tenant))
            .reduce(f64::min)
    }

    /// The waiter that goes first among `waiters` (by index).
    fn first<'w>(&self, waiters: impl Iterator<Item = (usize, &'w Waiter)>) -> Option<usize> {
        waiters
            .min_by(|(_, a), (_, b)| {
                let (a, b) = (self.order(a), self.order(b));
                a.partial_cmp(&b).unwrap_or(std::cmp::Ordering::Equal)
            })
            .map(|(i, _)| i)
    }

    /// The waiter that goes next, among those neither woken nor passed.
    fn next(&self) -> Option<usize> {
        let candidates = self.waiters.iter().enumerate();
        self.first(candidates.filter(|(_, w)| !w.woken && !w.passed))
    }

    fn wake(&mut self) -> bool {
        match self.next() {
            Some(i) => {
                self.waiters[i].woken = true;
                self.waiters[i].wake.notify_one();
                true
            }
            None => false,
        }
    }
}

impl FairQueue {
    /// Requests of each class waiting now.
    pub fn depth_of(&self, class: usize) -> usize {
        let inner = self.inner.lock();
        inner
            .waiters
            .iter()
            .filter(|w| w.who.class == class)
            .count()
    }

    /// Joins if fewer than `max` wait in all and fewer than `class_max` in its class:
    /// its id and wake-up. A tenant not waiting yet is lifted to the lowest counter of
    /// its class's waiting tenants.
    pub fn join(&self, who: Waiting, max: usize, class_max: usize) -> Option<(u64, Arc<Notify>)> {
        let mut inner = self.inner.lock();
        let in_class = inner
            .waiters
            .iter()
            .filter(|w| w.who.class == who.class)
            .count();
        if inner.waiters.len() >= max || in_class >= class_max {
            return None;
        }
        let waiting = |t: &Arc<str>| {
            inner
                .waiters
                .iter()
                .any(|w| w.who.class == who.class && w.who.tenant == *t)
        };
        if !waiting(&who.tenant) {
            if let Some(floor) = inner.floor(who.class) {
                if inner.counter(who.class, &who.tenant) < floor {
                    inner
                        .counters
                        .insert((who.class, who.tenant.clone()), floor);
                }
            }
        }
        let id = inner.next_id;
        inner.next_id += 1;
        let wake = Arc::new(Notify::new());
        inner.waiters.push(Waiter {
            id,
            who,
            wake: wake.clone(),
            woken: false,
            passed: false,
        });
        Some((id, wake))
    }

    /// How many waiters would go before a request of `who` that joined now.
    pub fn ahead(&self, who: &Waiting) -> usize {
        let inner = self.inner.lock();
        let own = inner.counter(who.class, &who.tenant);
        let own = inner.floor(who.class).map_or(own, |f| own.max(f));
        inner
            .waiters
            .iter()
            .filter(|w| {
                let (class, counter, _) = inner.order(w);
                (class, counter) <= (who.class, own)
            })
            .count()
    }

    /// Whether `id` goes first of all waiters (woken or not).
    pub fn is_first(&self, id: u64) -> bool {
        let inner = self.inner.lock();
        let first = inner.first(inner.waiters.iter().enumerate());
        first.is_some_and(|i| inner.waiters[i].id == id)
    }

    /// Capacity came back without a slot being freed (a node undrained, healthy
    /// again): wakes the next waiter unless one is awake already.
    pub fn wake_if_idle(&self) {
        let mut inner = self.inner.lock();
        if !inner.waiters.iter().any(|w| w.woken) {
            inner.wake();
        }
    }

    /// A freed slot: wakes the waiter that goes next. Returns whether one was woken.
    pub fn wake_next(&self) -> bool {
        let mut inner = self.inner.lock();
        for w in &mut inner.waiters {
            w.passed = false;
        }
        inner.wake()
    }

    /// A woken waiter found its slot taken (by a request that did not queue): it waits
    /// on, first in line for the next.
    pub fn rest(&self, id: u64) {
        let mut inner = self.inner.lock();
        if let Some(w) = inner.waiters.iter_mut().find(|w| w.id == id) {
            w.woken = false;
        }
    }

    /// A woken waiter found no slot it may take: the wake-up goes to the next one.
    pub fn pass(&self, id: u64) {
        let mut inner = self.inner.lock();
        if let Some(w) = inner.waiters.iter_mut().find(|w| w.id == id) {
            w.woken = false;
            w.passed = true;
        }
        inner.wake();
    }

    /// Leaves the queue: admitted (its tenant charged its cost) or not (gave up, shed,
    /// its client left). A woken waiter that leaves unadmitted passes its wake-up on.
    pub fn leave(&self, id: u64, admitted: bool) {
        let mut inner = self.inner.lock();
        let Some(i) = inner.waiters.iter().position(|w| w.id == id) else {
            return;
        };
        let w = inner.waiters.swap_remove(i);
        if admitted {
            let key = (w.who.class, w.who.tenant.clone());
            let charge = w.who.cost / w.who.weight.max(0.01);
            *inner.counters.entry(key).or_insert(0.0) += charge;
        } else if w.woken {
            inner.wake();
        }
        if inner.counters.len() > MAX_COUNTERS {
            let waiting: Vec<(usize, Arc<str>)> = inner
                .waiters
                .iter()
                .map(|w| (w.who.class, w.who.tenant.clone()))
                .collect();
            inner.counters.retain(|k, _| waiting.contains(k));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn who(tenant: &str, class: usize, cost: f64) -> Waiting {
        Waiting {
            tenant: tenant.into(),
            class,
            weight: 1.0,
            cost,
        }
    }

    /// Admits whoever goes next, `n` times; the tenants in order.
    fn admit(q: &FairQueue, ids: &mut Vec<(u64, Arc<str>)>, n: usize) -> Vec<String> {
        let mut out = Vec::new();
        for _ in 0..n {
            let i = q.inner.lock().next().unwrap();
            let id = q.inner.lock().waiters[i].id;
            let pos = ids.iter().position(|(x, _)| *x == id).unwrap();
            out.push(ids.remove(pos).1.to_string());
            q.leave(id, true);
        }
        out
    }

    #[test]
    fn a_higher_class_goes_first_and_tenants_of_a_class_share_by_tokens() {
        let q = FairQueue::default();
        let mut ids = Vec::new();
        for _ in 0..20 {
            ids.push((
                q.join(who("batch", 1, 100.0), 1000, 1000).unwrap().0,
                "batch".into(),
            ));
        }
        for _ in 0..10 {
            ids.push((
                q.join(who("flood", 0, 1000.0), 1000, 1000).unwrap().0,
                "flood".into(),
            ));
            ids.push((
                q.join(who("trickle", 0, 100.0), 1000, 1000).unwrap().0,
                "trickle".into(),
            ));
        }
        let order = admit(&q, &mut ids, 20);
        // Class 0 first; its tenants by tokens: the trickle's ten requests cost what one
        // of the flood's does, so the trickle is never starved behind the flood.
        assert!(order.iter().all(|t| t != "batch"), "{order:?}");
        let trickle_first_half = order[..10].iter().filter(|t| *t == "trickle").count();
        assert!(trickle_first_half >= 8, "{order:?}");
        assert_eq!(admit(&q, &mut ids, 20), vec!["batch"; 20]);
    }

    #[test]
    fn a_tenant_that_starts_waiting_banks_no_credit_and_bounds_hold() {
        let q = FairQueue::default();
        let mut ids = Vec::new();
        // `a` has been served a lot alone; then `b` arrives with the same work.
        for _ in 0..50 {
            let (id, _) = q.join(who("a", 0, 100.0), 100, 100).unwrap();
            q.leave(id, true);
        }
        for _ in 0..4 {
            ids.push((q.join(who("a", 0, 100.0), 100, 100).unwrap().0, "a".into()));
        }
        for _ in 0..4 {
            ids.push((q.join(who("b", 0, 100.0), 100, 100).unwrap().0, "b".into()));
        }
        // b is lifted to a's counter: they alternate, b does not take eight turns.
        let order = admit(&q, &mut ids, 8);
        let b_first4 = order[..4].iter().filter(|t| *t == "b").count();
        assert!((1..=3).contains(&b_first4), "{order:?}");
        // Bounds: in all, and per class.
        assert!(q.join(who("c", 0, 1.0), 1, 10).is_some());
        assert!(q.join(who("c", 0, 1.0), 1, 10).is_none(), "max");
        let q = FairQueue::default();
        assert!(q.join(who("c", 1, 1.0), 10, 1).is_some());
        assert!(q.join(who("c", 1, 1.0), 10, 1).is_none(), "class max");
        assert!(q.join(who("c", 0, 1.0), 10, 1).is_some(), "another class");
    }

    #[test]
    fn a_wake_up_goes_to_one_waiter_and_is_passed_on_when_unused() {
        let q = FairQueue::default();
        let (a, _) = q.join(who("a", 0, 1.0), 10, 10).unwrap();
        let (b, _) = q.join(who("b", 0, 1.0), 10, 10).unwrap();
        assert!(q.wake_next());
        let woken = |id| q.inner.lock().waiters.iter().any(|w| w.id == id && w.woken);
        assert!(woken(a) && !woken(b));
        // a finds its slot taken by a request that did not queue: it rests, and the
        // next freed slot is offered to it first again.
        q.rest(a);
        assert!(!woken(a) && !woken(b));
        assert!(q.wake_next());
        assert!(woken(a) && !woken(b));
        q.pass(a);
        assert!(woken(b) && !woken(a));
        // b cannot use it either: nobody is left to offer it to (it is not bounced
        // back to a), until the next slot frees.
        q.pass(b);
        assert!(!woken(a) && !woken(b));
        assert!(q.wake_next());
        assert!(woken(a));
        // a leaves without a slot: the wake-up goes to b.
        q.leave(a, false);
        assert!(woken(b));
        q.leave(b, true);
        assert!(!q.wake_next(), "nobody waits");
    }
}
