//! Readers resolving batches while a writer publishes new snapshots see only whole snapshots.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use tidings_router::{GroupObservation, HashToSlot, Router};
use tidings_types::{ConfigEpoch, GroupId, NodeId, Term};

/// The writer publishes term `t` with leader `t % 3 + 1`. A reader that ever sees a route whose leader
/// does not match its term, a batch with mixed revisions, or a revision going backwards has seen a torn
/// or reordered snapshot.
#[test]
fn batch_resolution_never_sees_a_torn_snapshot() {
    let router = Arc::new(Router::new(HashToSlot::even_split(1).unwrap()));
    publish_term(&router, 1);
    let stop = Arc::new(AtomicBool::new(false));
    let keys: Arc<Vec<Vec<u8>>> = Arc::new((0..512).map(|i| format!("uid-{i}").into_bytes()).collect());

    let readers: Vec<_> = (0..3)
        .map(|_| {
            let (router, stop, keys) = (Arc::clone(&router), Arc::clone(&stop), Arc::clone(&keys));
            thread::spawn(move || {
                let mut batches = 0u64;
                let mut last_revision = 0;
                while !stop.load(Ordering::Relaxed) || batches == 0 {
                    let snapshot = router.snapshot();
                    assert!(snapshot.revision().get() >= last_revision, "revision went backwards");
                    last_revision = snapshot.revision().get();
                    let routes = snapshot.resolve_many(keys.iter().map(Vec::as_slice));
                    let first = routes[0].clone().unwrap();
                    assert_eq!(first.leader, leader_of(first.leader_term.get()));
                    for route in routes {
                        let route = route.unwrap();
                        assert_eq!(route.route_revision, first.route_revision);
                        assert_eq!((route.leader_term, route.leader), (first.leader_term, first.leader));
                    }
                    batches += 1;
                }
                batches
            })
        })
        .collect();

    for term in 2..=500 {
        publish_term(&router, term);
    }
    stop.store(true, Ordering::Relaxed);
    for reader in readers {
        assert!(reader.join().unwrap() > 0);
    }
    let route = router.snapshot().resolve(b"uid-1").unwrap();
    assert_eq!(route.leader_term, Term::new(500));
    assert_eq!(route.route_revision.get(), 501);
}

fn leader_of(term: u64) -> NodeId {
    NodeId::new(term % 3 + 1)
}

fn publish_term(router: &Router, term: u64) {
    let observation = GroupObservation {
        leader: Some(leader_of(term)),
        term: Term::new(term),
        voters: vec![NodeId::new(1), NodeId::new(2), NodeId::new(3)],
        learners: vec![],
        config_epoch: ConfigEpoch::new(1),
    };
    router.observe(GroupId::new(1), observation).unwrap();
}
