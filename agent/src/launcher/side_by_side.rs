//! A launch's ranks prepared and spawned side by side rather than one after another.
//!
//! Each rank's record waits on the disk (a synced file and its directory) and its shim's spawn
//! on the kernel (fork, exec); one thread per rank lets those waits overlap, and the launch
//! takes about as long as its slowest rank rather than the sum of them.

/// `f` over every item, each on a scoped thread of its own (inline for a single item), in the
/// calling thread's Tokio runtime context where it has one (a shim's spawn registers its child
/// with the runtime). The results come back in the items' order.
pub(super) fn each<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    if items.len() <= 1 {
        return items.iter().map(f).collect();
    }
    let runtime = tokio::runtime::Handle::try_current().ok();
    let (f, runtime) = (&f, &runtime);
    std::thread::scope(|scope| {
        let threads: Vec<_> = items
            .iter()
            .map(|item| {
                std::thread::Builder::new().name("launch-rank".into()).spawn_scoped(scope, move || {
                    let _entered = runtime.as_ref().map(tokio::runtime::Handle::enter);
                    f(item)
                })
            })
            .collect();
        threads
            .into_iter()
            .zip(items)
            .map(|(thread, item)| match thread {
                Ok(thread) => thread.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
                // No thread to be had: this rank's work on the calling thread.
                Err(_) => f(item),
            })
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_come_back_in_order_and_run_on_threads_of_their_own() {
        let caller = std::thread::current().id();
        let out = each(&[1, 2, 3, 4], |&n| (n * 10, std::thread::current().id() != caller));
        assert_eq!(out.iter().map(|o| o.0).collect::<Vec<_>>(), vec![10, 20, 30, 40]);
        assert!(out.iter().all(|o| o.1), "each item ran off the calling thread");
        let one = each(&[7], |&n| (n, std::thread::current().id() == caller));
        assert_eq!(one, vec![(7, true)], "a single item runs inline");
    }

    #[test]
    fn the_items_overlap() {
        let started = std::time::Instant::now();
        each(&[(); 4], |()| std::thread::sleep(std::time::Duration::from_millis(100)));
        assert!(started.elapsed() < std::time::Duration::from_millis(350), "{:?}", started.elapsed());
    }

    #[tokio::test]
    async fn threads_see_the_callers_runtime() {
        let seen = each(&[(); 3], |()| tokio::runtime::Handle::try_current().is_ok());
        assert_eq!(seen, vec![true; 3]);
    }
}
