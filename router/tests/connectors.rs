//! Upstream connections are pooled per thread: a connection is registered with the runtime of
//! the thread that opened it, so one handed to a request on another thread would wake that
//! thread for every read (health checks opened the connections proxied requests then reused).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvgate_router::Gateway;

#[test]
fn each_thread_has_a_connector_of_its_own() {
    let config = kvgate_router::config::parse_str(
        "listen: \"127.0.0.1:1\"\nreplicas:\n  - url: \"http://127.0.0.1:9\"\n    models: [m]\n",
    )
    .unwrap();
    let gateway = Gateway::new(config, None).unwrap();
    let here = std::ptr::from_ref(gateway.connector()) as usize;
    assert_eq!(here, std::ptr::from_ref(gateway.connector()) as usize);
    let there = std::thread::scope(|s| {
        s.spawn(|| std::ptr::from_ref(gateway.connector()) as usize)
            .join()
            .unwrap()
    });
    assert_ne!(here, there, "another thread shares this thread's pool");
}
