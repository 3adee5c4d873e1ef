//! [`Pending`]: the outcome of a call the node finishes on another thread (an append, a metadata write),
//! to block on or to `.await` on any async runtime.

use crate::node::NodeError;
use parking_lot::{Condvar, Mutex};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};
use tidings_types::Seq;

/// A pending append: [`Pending::wait`] blocks a thread for its seqs; as a [`Future`] it wakes its task
/// instead.
///
/// ```no_run
/// # async fn demo(node: &tidings::Node, channel: tidings::types::ChannelId) -> Result<(), tidings::node::NodeError> {
/// use tidings::channel::machine::AppendRecord;
/// let record = AppendRecord { idempotency_key: None, payload: bytes::Bytes::from_static(b"hi") };
/// let seqs = node.append(channel, vec![record])?.await?;
/// # let _ = seqs; Ok(()) }
/// ```
pub type AppendHandle = Pending<Vec<Seq>>;

/// A call in progress: [`Pending::wait`] blocks a thread for its outcome; as a [`Future`] it wakes its task
/// instead (it needs no particular runtime: the node thread that finishes the call calls the waker).
#[must_use = "the call goes ahead anyway; this is how its outcome is learned"]
pub struct Pending<T> {
    shared: Arc<Shared<T>>,
}

/// The other end of a [`Pending`], held by whoever finishes the call. Dropped without completing (the
/// node stopped with the call in flight), it completes it with `Stopped`.
pub(super) struct Completer<T> {
    shared: Arc<Shared<T>>,
}

type Outcome<T> = Result<T, NodeError>;

struct Shared<T> {
    state: Mutex<State<T>>,
    done: Condvar,
}

struct State<T> {
    outcome: Option<Outcome<T>>,
    /// Set once completed: the outcome may have been taken since.
    completed: bool,
    waker: Option<Waker>,
}

impl<T> Pending<T> {
    /// A pending outcome and the completer that fulfils it.
    pub(super) fn new() -> (Pending<T>, Completer<T>) {
        let state = State { outcome: None, completed: false, waker: None };
        let shared = Arc::new(Shared { state: Mutex::new(state), done: Condvar::new() });
        (Pending { shared: Arc::clone(&shared) }, Completer { shared })
    }

    /// An outcome known at once (a call refused before it started).
    pub(super) fn ready(outcome: Outcome<T>) -> Pending<T> {
        let (pending, completer) = Pending::new();
        completer.complete(outcome);
        pending
    }

    /// Waits for the outcome (an append: until it commits or fails). [`NodeError::TimedOut`] if none came
    /// within `timeout` (the call may still take effect).
    pub fn wait_for(self, timeout: Duration) -> Outcome<T> {
        let deadline = Instant::now() + timeout;
        let mut state = self.shared.state.lock();
        while !state.completed {
            if self.shared.done.wait_until(&mut state, deadline).timed_out() {
                return Err(NodeError::TimedOut);
            }
        }
        state.outcome.take().unwrap_or(Err(NodeError::Stopped))
    }

    /// Waits for the outcome, at most 30 s (an append's own timeout, `MachineConfig::append_timeout`,
    /// and a metadata write's, `RaftConfig::propose_timeout`, end them well before).
    pub fn wait(self) -> Outcome<T> {
        self.wait_for(super::CALL_TIMEOUT)
    }
}

impl<T> Future for Pending<T> {
    type Output = Outcome<T>;

    fn poll(self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<Self::Output> {
        let mut state = self.shared.state.lock();
        if state.completed {
            // Polled again after it returned `Ready`: the outcome is gone.
            return Poll::Ready(state.outcome.take().unwrap_or(Err(NodeError::Stopped)));
        }
        match &mut state.waker {
            Some(waker) if waker.will_wake(context.waker()) => {}
            waker => *waker = Some(context.waker().clone()),
        }
        Poll::Pending
    }
}

impl<T> Completer<T> {
    /// Hands the outcome over, waking whoever waits on it.
    pub(super) fn complete(self, outcome: Outcome<T>) {
        self.fulfil(outcome);
    }

    fn fulfil(&self, outcome: Outcome<T>) {
        let waker = {
            let mut state = self.shared.state.lock();
            if state.completed {
                return;
            }
            state.completed = true;
            state.outcome = Some(outcome);
            state.waker.take()
        };
        self.shared.done.notify_all();
        // Outside the lock: a waker may poll at once on this thread.
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

impl<T> Drop for Completer<T> {
    fn drop(&mut self) {
        // A no-op once completed.
        self.fulfil(Err(NodeError::Stopped));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::Wake;

    /// Counts its wake-ups.
    #[derive(Default)]
    struct CountingWaker(AtomicUsize);

    impl Wake for CountingWaker {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn poll<T>(handle: &mut Pending<T>, waker: &Arc<CountingWaker>) -> Poll<Outcome<T>> {
        let waker = Waker::from(Arc::clone(waker));
        Pin::new(handle).poll(&mut Context::from_waker(&waker))
    }

    #[test]
    fn a_polled_handle_is_woken_once_completed_and_then_ready_with_the_outcome() {
        let (mut handle, completer) = AppendHandle::new();
        let waker = Arc::new(CountingWaker::default());
        assert!(poll(&mut handle, &waker).is_pending());
        assert!(poll(&mut handle, &waker).is_pending(), "polled again before completion");
        assert_eq!(waker.0.load(Ordering::SeqCst), 0);
        completer.complete(Ok(vec![Seq::new(7)]));
        assert_eq!(waker.0.load(Ordering::SeqCst), 1, "woken once");
        assert!(matches!(poll(&mut handle, &waker), Poll::Ready(Ok(seqs)) if seqs == vec![Seq::new(7)]));
    }

    #[test]
    fn a_completer_dropped_without_an_outcome_ends_the_wait_with_stopped() {
        let (mut handle, completer) = AppendHandle::new();
        let waker = Arc::new(CountingWaker::default());
        assert!(poll(&mut handle, &waker).is_pending());
        drop(completer);
        assert_eq!(waker.0.load(Ordering::SeqCst), 1);
        assert!(matches!(poll(&mut handle, &waker), Poll::Ready(Err(NodeError::Stopped))));

        let (handle, completer) = AppendHandle::new();
        let waiting = std::thread::spawn(move || handle.wait());
        drop(completer);
        assert!(matches!(waiting.join().unwrap(), Err(NodeError::Stopped)));
    }

    #[test]
    fn wait_returns_an_outcome_completed_on_another_thread_and_times_out_without_one() {
        let (handle, completer) = AppendHandle::new();
        let completing = std::thread::spawn(move || completer.complete(Ok(vec![Seq::new(1), Seq::new(2)])));
        assert_eq!(handle.wait().unwrap(), vec![Seq::new(1), Seq::new(2)]);
        completing.join().unwrap();

        let (handle, _completer) = AppendHandle::new();
        assert!(matches!(handle.wait_for(Duration::from_millis(20)), Err(NodeError::TimedOut)));
    }
}
