//! The `nvidia-smi topo -m` parser on real-looking outputs of every node class
//! (tests/fixtures/topo/), on its own rendering, and on malformed input.

use std::path::PathBuf;

use trainyard_agent::topology::{Link, Topology, compare, explain, parse, render};
use trainyard_proto::words::InterconnectClass;

fn fixture(name: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/topo").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

fn parsed(name: &str) -> Topology {
    parse(&fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

#[test]
fn h100_sxm_on_one_numa_node() {
    let t = parsed("h100-sxm-1numa.txt");
    assert_eq!(t.gpus.len(), 8);
    assert_eq!(t.class(), InterconnectClass::Nvswitch);
    assert!(
        t.links
            .iter()
            .enumerate()
            .all(|(i, r)| r.iter().enumerate().all(|(j, l)| (i == j) == (*l == Link::X)))
    );
    assert_eq!(t.links[3][6], Link::Nv(18));
    assert_eq!(t.numa_layout(), "0:8");
    assert_eq!(t.cpus_on_node(0), 208);
    assert!(t.nics.is_empty());
}

#[test]
fn h100_sxm_split_over_two_numa_nodes_with_nics() {
    let t = parsed("h100-sxm-2numa.txt");
    assert_eq!(t.class(), InterconnectClass::Nvswitch);
    assert_eq!(t.numa_layout(), "0:4 1:4");
    assert_eq!(t.gpus[5].cpus, "56-111,168-223");
    assert_eq!(t.numa_nodes.len(), 2);
    assert_eq!(t.nics.len(), 8);
    assert_eq!(t.nics[2].name, "mlx5_2");
    assert_eq!(t.nics[2].to_gpus[2], Link::Pix);
    assert_eq!(t.nics[2].to_gpus[6], Link::Sys);
    assert_eq!(t.nics[0].to_nics[0], Link::X);
}

#[test]
fn h100_nvl_is_nvlink_pairs() {
    let t = parsed("h100-nvl.txt");
    assert_eq!(t.class(), InterconnectClass::NvlinkPairs);
    assert_eq!(t.links[4][5], Link::Nv(12));
    assert_eq!(t.links[0][2], Link::Node);
    assert_eq!(t.links[0][7], Link::Sys);
}

#[test]
fn h100_pcie_is_pcie() {
    let t = parsed("h100-pcie.txt");
    assert_eq!(t.class(), InterconnectClass::Pcie);
    assert_eq!(t.links[6][7], Link::Pxb);
    assert_eq!(t.numa_layout(), "0:4 1:4");
}

#[test]
fn h200_sxm_with_terminal_escape_codes() {
    let t = parsed("h200-sxm.txt");
    assert_eq!(t.class(), InterconnectClass::Nvswitch);
    assert_eq!(t.nics.len(), 4);
    assert_eq!(t.nics[1].to_gpus[3], Link::Pxb);
    assert_eq!(t.gpus[7].numa_node, Some(1));
}

#[test]
fn rendering_reads_back_to_the_same_topology() {
    for name in ["h100-sxm-1numa.txt", "h100-sxm-2numa.txt", "h100-nvl.txt", "h100-pcie.txt", "h200-sxm.txt"]
    {
        let t = parsed(name);
        let text = render(&t);
        assert!(text.lines().next().unwrap().contains("CPU Affinity\tNUMA Affinity"), "{text}");
        assert!(text.contains("NV#  = Connection traversing a bonded set of # NVLinks"));
        assert_eq!(parse(&text).unwrap(), t, "{name}");
    }
}

#[test]
fn spaces_instead_of_tabs_parse_the_same() {
    let tabs = fixture("h100-nvl.txt");
    let spaces = tabs.replace('\t', "   ");
    assert_eq!(parse(&spaces).unwrap(), parse(&tabs).unwrap());
}

/// The error for `text` names `line` and says `what`.
fn refused(text: &str, line: usize, what: &str) {
    let e = parse(text).expect_err("must be refused");
    assert_eq!(e.line, line, "{e}");
    assert!(e.to_string().starts_with(&format!("line {line}: ")), "{e}");
    assert!(e.to_string().contains(what), "{e} does not say {what:?}");
}

#[test]
fn malformed_input_names_the_line() {
    let good = fixture("h100-nvl.txt");
    let lines: Vec<&str> = good.lines().collect();
    let with = |i: usize, new: &str| {
        let mut l = lines.clone();
        l[i] = new;
        l.join("\n")
    };
    refused("", 1, "empty");
    refused("hello world\n", 1, "no GPU columns");
    refused("\tGPU0\tGPU1\n", 1, "CPU Affinity");
    refused("\tGPU1\tGPU0\tCPU Affinity\tNUMA Affinity\n", 1, "out of order");
    // A cell that is no link code.
    refused(&with(3, &lines[3].replace("NV12", "NV??")), 4, "\"NV??\" is not a link code");
    // A row cut short.
    refused(&with(5, "GPU4\tSYS\tSYS"), 6, "row GPU4 has 2 cells, expected 8");
    // Asymmetric: GPU2->GPU0 disagrees with GPU0->GPU2.
    refused(
        &with(3, &lines[3].replacen("NODE", "SYS", 1)),
        4,
        "GPU2 to GPU0 is SYS but GPU0 to GPU2 is NODE",
    );
    // X off the diagonal.
    refused(&with(2, &lines[2].replacen("NV12", "X", 1)), 3, "expected a link code");
    // GPU0's own row is named, not the header above it (whose first column is GPU0 too).
    refused(&with(1, &lines[1].replacen(" X ", "NV12", 1)), 2, "GPU0 column GPU0 is NV12");
    // A missing GPU row.
    let short: String =
        lines.iter().enumerate().filter(|(i, _)| *i != 8).map(|(_, l)| format!("{l}\n")).collect();
    refused(&short, 10, "lists 8 GPUs but 7 GPU rows follow");
    // A row out of order, an unknown label, a bad affinity.
    refused(&with(2, lines[3]), 3, "out of order");
    refused(&with(9, "mlx5_9\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS"), 10, "not a column");
    refused(&with(1, &lines[1].replace("0-47,96-143", "0-47;96")), 2, "CPU Affinity");
    refused(&with(1, &lines[1].replace("96-143\t0", "96-143\tzero")), 2, "NUMA Affinity");
}

/// As operators paste it: the prompt and command above the matrix, the next prompt and other
/// output after it, and what a copy leaves of the header's escape codes.
#[test]
fn a_paste_with_prompts_other_output_and_escape_residue_reads_as_the_matrix() {
    let clean = fixture("h200-sxm.txt");
    let want = parse(&clean).unwrap();
    let residue = clean.replace('\u{1b}', "");
    assert!(residue.contains("[4mGPU0"), "the fixture's header is underlined");
    let caret = clean.replace('\u{1b}', "^[");
    for header in [&residue, &caret] {
        let pasted = format!(
            "ops@gpu-node-17:~$ nvidia-smi topo -m\n{header}\nops@gpu-node-17:~$ nvidia-smi -L\n\
             GPU 0: NVIDIA H200 (UUID: GPU-0d7c)\nops@gpu-node-17:~$\n"
        );
        assert_eq!(parse(&pasted).unwrap(), want);
    }
    // Output between the GPU rows and the legend is passed over too; the legend still names NICs.
    let lines: Vec<&str> = clean.lines().collect();
    let mut spliced = lines[..9].to_vec();
    spliced.push("(the NIC rows were cut from this paste)");
    spliced.extend(&lines[9..]);
    let t = parse(&spliced.join("\n")).unwrap();
    assert_eq!(t.gpus, want.gpus);
    assert_eq!(
        t.nics.iter().map(|n| n.name.clone()).collect::<Vec<_>>(),
        ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
    );
}

#[test]
fn errors_in_a_pasted_matrix_name_the_line_of_the_paste() {
    let good = fixture("h100-nvl.txt");
    let matrix: Vec<&str> = good.lines().collect();
    // Two prompt lines above the matrix: its line i is line i + 2 of the paste.
    let paste = |matrix: &[&str]| format!("$ ssh gpu-node-3\n$ nvidia-smi topo -m\n{}\n", matrix.join("\n"));
    let with = |i: usize, new: &str| {
        let mut m = matrix.clone();
        m[i] = new;
        paste(&m)
    };
    refused(&with(3, &matrix[3].replace("NV12", "NV??")), 4 + 2, "\"NV??\" is not a link code");
    // A paste cut off after GPU5, with the next prompt after it.
    let mut cut = matrix[..7].to_vec();
    cut.push("$ exit");
    refused(&paste(&cut), 8 + 2, "only 6 GPU rows come before this line");
    // A line that reads as a row of the matrix but names no column is refused, not passed over.
    let mut stray = matrix[..9].to_vec();
    stray.push("mlx5_9\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS");
    refused(&paste(&stray), 10 + 2, "not a column");
}

/// Captured on a 1-GPU H100 virtual machine (driver 580): the header has a `GPU NUMA ID`
/// column, the GPU row has one more cell than the header (an empty one before `N/A`), and the
/// header is wrapped in underline escape codes.
#[test]
fn one_gpu_vm_as_nvidia_smi_580_prints_it() {
    let t = parsed("h100-1gpu-vm.txt");
    assert_eq!(t.gpus.len(), 1);
    assert_eq!(t.links, vec![vec![Link::X]]);
    assert_eq!(t.gpus[0].cpus, "0-15");
    assert_eq!(t.gpus[0].numa_node, Some(0));
    assert_eq!(t.numa_layout(), "0:1");
}

/// A NUMA Affinity range (`0-1`: the platform ties the GPU to several nodes) is read as such,
/// not refused, and renders back the same.
#[test]
fn a_numa_range_is_several_nodes() {
    let text = fixture("h100-nvl.txt").replacen("96-143\t0", "96-143\t0-1", 1);
    let t = parse(&text).expect("a range parses");
    assert_eq!(t.gpus[0].numa_affinity, vec![0, 1]);
    assert_eq!(t.gpus[0].numa_node, None);
    assert_eq!(t.gpus[1].numa_node, Some(0));
    assert_eq!(parse(&render(&t)).expect("render reads back"), t);
    let text = explain(&t);
    assert!(text.contains("GPU0: NUMA nodes 0-1 (several)"), "{text}");
    assert!(text.contains("GPU0 report several NUMA nodes"), "{text}");
}

/// What each class means, with the field's costs.
#[test]
fn explain_names_the_class_the_split_and_their_costs() {
    let nvl = explain(&parsed("h100-nvl.txt"));
    assert!(nvl.starts_with("class: nvlink-pairs (8 GPUs, worst GPU-GPU path SYS)"), "{nvl}");
    assert!(nvl.contains("2031 ms per step against 702 ms"), "{nvl}");
    assert!(nvl.contains("GPUs split over 2 NUMA nodes (0:4 1:4)"), "{nvl}");
    assert!(nvl.contains("1295 ms per step instead of 702 ms"), "{nvl}");
    assert!(nvl.contains("GPU4: NUMA node 1, CPUs 48-95,144-191"), "{nvl}");
    let sxm = explain(&parsed("h100-sxm-1numa.txt"));
    assert!(sxm.starts_with("class: nvswitch (8 GPUs, worst GPU-GPU path NV18)"), "{sxm}");
    assert!(!sxm.contains("split"), "{sxm}");
    let pcie = explain(&parsed("h100-pcie.txt"));
    assert!(pcie.contains("1412 ms per step"), "{pcie}");
    let nics = explain(&parsed("h100-sxm-2numa.txt"));
    assert!(nics.contains("mlx5_2: GPU2 (PIX)"), "{nics}");
    let one = explain(&parsed("h100-1gpu-vm.txt"));
    assert!(one.contains("one GPU: no GPU-to-GPU traffic"), "{one}");
}

/// NVML's view of the 1-GPU H100 VM (the inventory its preflight printed, committed under
/// docs/gpu-results/) agrees cell for cell with that machine's `nvidia-smi topo -m`; a changed
/// link, CPU list or NUMA node is reported by name.
#[test]
fn nvml_and_nvidia_smi_views_compare_cell_for_cell() {
    use trainyard_proto::v1::{Gpu, HostInventory, NumaNode};
    let inventory = HostInventory {
        hostname: "vm".into(),
        gpus: vec![Gpu {
            index: 0,
            uuid: "GPU-9755e7df-acbd-f438-f3da-904cad73240b".into(),
            model: "NVIDIA H100 80GB HBM3".into(),
            memory_mib: 81559,
            pci_bus_id: "00000000:00:06.0".into(),
            numa_node: 0,
        }],
        numa_nodes: vec![NumaNode { id: 0, cpus: "0-15".into() }],
        links: vec!["X".into()],
        cores: vec![],
    };
    let nvml = Topology::from_inventory(&inventory).expect("inventory");
    assert_eq!(compare("NVML", &nvml, "nvidia-smi", &parsed("h100-1gpu-vm.txt")), Vec::<String>::new());

    let smi = parsed("h100-nvl.txt");
    assert!(compare("a", &smi, "b", &smi).is_empty());
    let mut broken = smi.clone();
    broken.links[0][1] = Link::Node;
    broken.links[1][0] = Link::Node;
    broken.gpus[2].cpus = "0-47".into();
    broken.gpus[3].numa_affinity = vec![1];
    let diffs = compare("NVML", &broken, "nvidia-smi", &smi);
    assert_eq!(
        diffs,
        vec![
            "GPU0 to GPU1: NVML NODE, nvidia-smi NV12",
            "GPU1 to GPU0: NVML NODE, nvidia-smi NV12",
            "GPU2 CPU affinity: NVML 0-47, nvidia-smi 0-47,96-143",
            "GPU3 NUMA affinity: NVML 1, nvidia-smi 0",
        ]
    );
    assert_eq!(compare("a", &parsed("h100-1gpu-vm.txt"), "b", &smi), vec!["a has 1 GPUs, b has 8"]);
}

/// `trainyard-agent topo FILE` and `topo -` (standard input) explain a pasted matrix; a cell it
/// cannot read is exit code 2 with the line named.
#[test]
fn topo_command_reads_a_file_or_stdin_and_names_bad_lines() {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let agent = env!("CARGO_BIN_EXE_trainyard-agent");
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/topo/h100-nvl.txt");
    let out = Command::new(agent).arg("topo").arg(&path).output().expect("run topo");
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.starts_with("class: nvlink-pairs"), "{stdout}");

    let bad = fixture("h100-nvl.txt").replacen("NV12", "NV??", 1);
    let mut child = Command::new(agent)
        .args(["topo", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn topo -");
    child.stdin.take().expect("stdin").write_all(bad.as_bytes()).expect("write stdin");
    let out = child.wait_with_output().expect("topo -");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("standard input: line 2: row GPU0, column 2"), "{stderr}");
}
