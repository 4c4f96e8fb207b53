//! The backend's threads: a fixed team that runs one parallel loop at a time together with the
//! calling thread. Between loops the helpers spin for a short while instead of sleeping: one
//! token's forward pass forks about 120 times, and a sleep and wake-up per fork (what a
//! work-stealing pool does when the gaps are a few microseconds) cost a fifth of the second
//! core. After `SPIN` without work they park, so an idle worker does not burn a core. Every
//! wait yields now and then, so that with more runnable threads than cores (other processes)
//! a thread being waited for is not kept off its core by the one waiting (measured on 2 busy
//! cores: 2-thread decode 2x faster than with pure spinning).
#![allow(unsafe_code)]

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a helper spins for the next loop before parking.
const SPIN: Duration = Duration::from_micros(300);

/// A loop body, with its lifetime erased (see `Team::for_each`).
type Body = *const (dyn Fn(usize) + Sync);

struct Job {
    body: Body,
    tasks: usize,
}

struct Shared {
    /// Bumped once per loop; helpers start when they see it change.
    generation: AtomicU64,
    /// The current loop; written only while no helper is inside one.
    job: std::cell::UnsafeCell<Job>,
    /// The next task of the current loop to claim.
    next: AtomicUsize,
    /// Helpers done with the current loop.
    finished: AtomicUsize,
    /// A loop is running (loops neither nest nor overlap: one `job` slot).
    busy: AtomicBool,
    /// A task panicked in a helper.
    panicked: AtomicBool,
    stop: AtomicBool,
    sleeping: AtomicUsize,
    park: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written by the owner only between loops (after every helper reported
// `finished` and before `generation` moves on), and read by helpers only inside a loop; the
// body it points to is `Sync`.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

pub struct Team {
    shared: Arc<Shared>,
    helpers: Vec<JoinHandle<()>>,
}

impl Team {
    /// A team of `threads` (the caller and `threads - 1` helpers).
    pub fn new(threads: usize) -> std::io::Result<Team> {
        let shared = Arc::new(Shared {
            generation: AtomicU64::new(0),
            job: std::cell::UnsafeCell::new(Job {
                body: &nothing,
                tasks: 0,
            }),
            next: AtomicUsize::new(0),
            finished: AtomicUsize::new(0),
            busy: AtomicBool::new(false),
            panicked: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            sleeping: AtomicUsize::new(0),
            park: Mutex::new(()),
            wake: Condvar::new(),
        });
        let size = threads.max(1);
        let mut team = Team {
            shared,
            helpers: Vec::new(),
        };
        for index in 1..size {
            let shared = team.shared.clone();
            // On failure, dropping `team` stops the helpers already started.
            let handle = std::thread::Builder::new()
                .name(format!("cpu-backend-{index}"))
                .spawn(move || helper(&shared))?;
            team.helpers.push(handle);
        }
        Ok(team)
    }

    pub fn threads(&self) -> usize {
        self.helpers.len() + 1
    }

    /// Runs `body(i)` once for every `i < tasks`, each on whichever thread of the team claims
    /// it next (so a slower thread takes fewer). Returns when all have run.
    pub fn for_each(&self, tasks: usize, body: impl Fn(usize) + Sync) {
        let n = self.threads();
        if n == 1 || tasks <= 1 {
            (0..tasks).for_each(body);
            return;
        }
        let s = &*self.shared;
        assert!(
            !s.busy.swap(true, Ordering::Acquire),
            "Team::for_each called from a task or from two threads at once"
        );
        let body: &(dyn Fn(usize) + Sync) = &body;
        // SAFETY: no helper is inside a loop (the previous call waited for all of them, and
        // `busy` rules out a nested or concurrent one), so nothing reads `job` now; the erased lifetime is sound because this function does not
        // return before every helper is done with `body`.
        unsafe {
            *s.job.get() = Job {
                body: std::mem::transmute::<&(dyn Fn(usize) + Sync), Body>(body),
                tasks,
            };
        }
        s.next.store(0, Ordering::SeqCst);
        s.finished.store(0, Ordering::SeqCst);
        s.generation.fetch_add(1, Ordering::SeqCst);
        if s.sleeping.load(Ordering::SeqCst) > 0 {
            let _guard = s.park.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        // The helpers hold `body` until they finish: wait for them even if a task here panics.
        let mine = catch_unwind(AssertUnwindSafe(|| claim(s, tasks, body)));
        let mut spins = 0u32;
        while s.finished.load(Ordering::Acquire) < n - 1 {
            pause(&mut spins);
        }
        s.busy.store(false, Ordering::Release);
        if let Err(panic) = mine {
            s.panicked.store(false, Ordering::SeqCst);
            std::panic::resume_unwind(panic);
        }
        assert!(
            !s.panicked.swap(false, Ordering::SeqCst),
            "a task panicked on a CPU backend thread"
        );
    }

    /// Runs `body(i, chunk)` over `data`'s chunks of `size` (the last may be shorter), spread
    /// over the team as `for_each` does.
    pub fn for_each_chunk<T: Send>(
        &self,
        data: &mut [T],
        size: usize,
        body: impl Fn(usize, &mut [T]) + Sync,
    ) {
        self.for_each_chunks([data], size, |_, i, chunk| body(i, chunk));
    }

    /// As `for_each_chunk` over several slices in one loop: `body(which, i, chunk)` for chunk
    /// `i` of `data[which]` (so that products sharing an input meet the team once).
    pub fn for_each_chunks<T: Send, const N: usize>(
        &self,
        data: [&mut [T]; N],
        size: usize,
        body: impl Fn(usize, usize, &mut [T]) + Sync,
    ) {
        let size = size.max(1);
        let counts = data.each_ref().map(|d| d.len().div_ceil(size));
        let parts = data.map(|d| (SendPtr(d.as_mut_ptr()), d.len()));
        self.for_each(counts.iter().sum(), |task| {
            let (mut which, mut i) = (0, task);
            while i >= counts[which] {
                i -= counts[which];
                which += 1;
            }
            let (base, len) = &parts[which];
            let start = i * size;
            let end = (start + size).min(*len);
            // SAFETY: chunk `i` of slice `which` is `start..end` of it, disjoint from every
            // other chunk, and each task runs exactly once; the slices outlive the loop.
            let chunk = unsafe { std::slice::from_raw_parts_mut(base.at(start), end - start) };
            body(which, i, chunk);
        });
    }
}

impl Team {
    /// Runs `body(i, a_i, b_i)` over the chunks of `a` (of `a_size`) and of `b` (of `b_size`)
    /// taken pairwise, as many as the shorter has: per-token work that writes two buffers.
    pub fn for_each_pair<A: Send, B: Send>(
        &self,
        (a, a_size): (&mut [A], usize),
        (b, b_size): (&mut [B], usize),
        body: impl Fn(usize, &mut [A], &mut [B]) + Sync,
    ) {
        let (a_size, b_size) = (a_size.max(1), b_size.max(1));
        let tasks = (a.len() / a_size).min(b.len() / b_size);
        let (a, b) = (SendPtr(a.as_mut_ptr()), SendPtr(b.as_mut_ptr()));
        self.for_each(tasks, |i| {
            // SAFETY: chunk `i` of each slice lies inside it (`i < tasks`), is disjoint from
            // every other chunk, and each index runs exactly once; the slices outlive the loop.
            let (a_i, b_i) = unsafe {
                (
                    std::slice::from_raw_parts_mut(a.at(i * a_size), a_size),
                    std::slice::from_raw_parts_mut(b.at(i * b_size), b_size),
                )
            };
            body(i, a_i, b_i);
        });
    }
}

/// A pointer that may cross to the team's threads (each uses a disjoint part of it).
struct SendPtr<T>(*mut T);

impl<T> SendPtr<T> {
    /// The address of element `i` (a method, so that closures capture the whole `SendPtr`).
    fn at(&self, i: usize) -> *mut T {
        self.0.wrapping_add(i)
    }
}

// SAFETY: see `for_each_chunk`: every thread touches only its own chunks.
unsafe impl<T: Send> Sync for SendPtr<T> {}
unsafe impl<T: Send> Send for SendPtr<T> {}

fn nothing(_: usize) {}

/// One round of waiting for another thread: a spin, and every 64th round a yield, so that a
/// thread we wait for that lost its core (more runnable threads than cores) gets it back
/// within a time slice instead of after ours.
fn pause(spins: &mut u32) {
    *spins = spins.wrapping_add(1);
    if spins.is_multiple_of(64) {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
}

/// Runs the current loop's tasks that this thread claims. (No claim can outlive its loop: the
/// owner resets `next` only after every helper has finished claiming.)
fn claim(s: &Shared, tasks: usize, body: &(dyn Fn(usize) + Sync)) {
    loop {
        let i = s.next.fetch_add(1, Ordering::Relaxed);
        if i >= tasks {
            return;
        }
        body(i);
    }
}

fn helper(s: &Shared) {
    let mut seen = 0;
    loop {
        let started = Instant::now();
        let mut spins = 0u32;
        loop {
            if s.stop.load(Ordering::Acquire) {
                return;
            }
            let generation = s.generation.load(Ordering::SeqCst);
            if generation != seen {
                seen = generation;
                break;
            }
            if !spins.is_multiple_of(256) || started.elapsed() < SPIN {
                pause(&mut spins);
                continue;
            }
            let mut guard = s.park.lock().unwrap_or_else(|e| e.into_inner());
            s.sleeping.fetch_add(1, Ordering::SeqCst);
            while s.generation.load(Ordering::SeqCst) == seen && !s.stop.load(Ordering::SeqCst) {
                guard = s.wake.wait(guard).unwrap_or_else(|e| e.into_inner());
            }
            s.sleeping.fetch_sub(1, Ordering::SeqCst);
        }
        // SAFETY: the owner wrote `job` before bumping `generation`, and does not write it
        // again before this helper reports `finished`.
        let job = unsafe { &*s.job.get() };
        // SAFETY: the body outlives the loop (see `Team::for_each`).
        let body = unsafe { &*job.body };
        let run = catch_unwind(AssertUnwindSafe(|| claim(s, job.tasks, body)));
        if run.is_err() {
            s.panicked.store(true, Ordering::SeqCst);
        }
        s.finished.fetch_add(1, Ordering::Release);
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        {
            let _guard = self.shared.park.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for helper in self.helpers.drain(..) {
            let _ = helper.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once_across_many_loops() {
        let team = Team::new(3).unwrap();
        for tasks in [0, 1, 2, 5, 64, 1000] {
            let counts: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
            team.for_each(tasks, |i| {
                counts[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 1));
        }
    }

    #[test]
    fn chunks_are_disjoint_and_cover_the_data() {
        let team = Team::new(2).unwrap();
        let mut data = vec![0usize; 1001];
        team.for_each_chunk(&mut data, 16, |i, chunk| {
            for (j, v) in chunk.iter_mut().enumerate() {
                *v += i * 16 + j;
            }
        });
        assert!(data.iter().enumerate().all(|(i, v)| i == *v));
    }

    #[test]
    fn pairs_follow_the_shorter_slice() {
        let team = Team::new(2).unwrap();
        let (mut a, mut b) = (vec![0usize; 30], vec![0usize; 4]);
        team.for_each_pair((&mut a, 10), (&mut b, 1), |i, a, b| {
            a.iter_mut().for_each(|v| *v = i);
            b[0] = i + 100;
        });
        assert_eq!(b, [100, 101, 102, 0]);
        assert!(a.iter().enumerate().all(|(j, v)| *v == j / 10));
    }

    #[test]
    fn a_nested_loop_is_refused() {
        let team = Team::new(2).unwrap();
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            team.for_each(4, |_| team.for_each(2, |_| {}));
        }));
        assert!(outcome.is_err());
        let sum = AtomicUsize::new(0);
        team.for_each(3, |i| {
            sum.fetch_add(i, Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 3);
    }

    #[test]
    fn helpers_wake_after_parking() {
        let team = Team::new(2).unwrap();
        std::thread::sleep(SPIN * 4);
        let sum = AtomicUsize::new(0);
        team.for_each(10, |i| {
            sum.fetch_add(i, Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 45);
    }

    #[test]
    fn a_panicking_task_is_reported_to_the_caller() {
        let team = Team::new(2).unwrap();
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            team.for_each(4, |i| assert!(i != 1, "task 1 fails"));
        }));
        assert!(outcome.is_err());
        // The team still works afterwards.
        let sum = AtomicUsize::new(0);
        team.for_each(4, |i| {
            sum.fetch_add(i, Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 6);
    }
}
